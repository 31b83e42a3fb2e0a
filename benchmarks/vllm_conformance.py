"""vLLM conformance: the protocol rtrl's gateway and `rtrl serve --vllm` rely on -- as
tests/support/vllm_stub.py implements it from vLLM v0.34.0's source -- checked against a running server.

    python benchmarks/vllm_conformance.py --url http://127.0.0.1:8000 --adapter DIR
        a vLLM started as docs/operations.md says (--logprobs-mode processed_logprobs, --enable-lora,
        --max-loras 3, VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-auto-tool-choice
        --tool-call-parser hermes); DIR a LoRA adapter of its base model (benchmarks/gpu_check.sh
        builds both)
    python benchmarks/vllm_conformance.py --stub
        the same checks against the stand-in (what the suite's tests run against)

Each check prints PASS or FAIL with what differed; the exit status is 1 if any failed. What the
stand-in does and a real vLLM does not is a defect of the stand-in: fix tests/support/vllm_stub.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import requests

ASK = [{"role": "user", "content": "Say hello."}]
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "look a key up",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


def _sse(answer: requests.Response) -> list[dict]:
    """A streamed answer's chunks (the [DONE] line checked, not returned)."""
    lines = [line for line in answer.iter_lines() if line.startswith(b"data: ")]
    assert lines and lines[-1] == b"data: [DONE]", f"the stream ends with {lines[-1:]!r}, not [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def check_models(url: str, base: str, adapter: Path) -> None:
    listed = requests.get(f"{url}/v1/models", timeout=30).json()
    assert listed["object"] == "list", listed
    cards = {m["id"]: m for m in listed["data"]}
    assert cards[base]["parent"] is None, cards[base]


def check_lora_endpoints(url: str, base: str, adapter: Path) -> None:
    name = "conformance-v1"
    load = requests.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)}, timeout=120
    )
    assert load.status_code == 200 and "added successfully" in load.text, (load.status_code, load.text)
    cards = {m["id"]: m for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"]}
    assert cards.get(name, {}).get("parent") == base, cards.get(name)
    again = requests.post(
        f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter)}, timeout=60
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"], again.text
    missing = requests.post(
        f"{url}/v1/load_lora_adapter",
        json={"lora_name": "conformance-none", "lora_path": "/nonexistent/adapter"},
        timeout=60,
    )
    assert missing.status_code == 404, (missing.status_code, missing.text)
    unload = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    assert unload.status_code == 200 and "removed successfully" in unload.text, unload.text
    gone = requests.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)
    assert gone.status_code == 404 and "cannot be found" in gone.json()["error"]["message"], gone.text


def check_unknown_model(url: str, base: str, adapter: Path) -> None:
    answer = requests.post(f"{url}/v1/chat/completions", json={"model": "no-such-model", "messages": ASK}, timeout=60)
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "model", answer.text


def check_processed_logprobs(url: str, base: str, adapter: Path) -> None:
    from deploy.serving.gateway import Gateway

    mode = Gateway(url, "conformance", None, None).check_logprobs()
    assert mode == "processed", f"the probe says {mode!r}: is vLLM started with --logprobs-mode processed_logprobs?"


def check_token_ids(url: str, base: str, adapter: Path) -> None:
    body = {
        "model": base,
        "messages": ASK,
        "max_tokens": 6,
        "logprobs": True,
        "return_token_ids": True,
        "n": 2,
        "temperature": 1.0,
        "seed": 1,
    }
    answer = requests.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert [c["index"] for c in answer["choices"]] == [0, 1], answer
    for c in answer["choices"]:
        ids, entries = c["token_ids"], c["logprobs"]["content"]
        assert isinstance(ids, list) and len(ids) == len(entries) > 0, c
        assert not any(e["token"].startswith("token_id:") for e in entries), entries[:2]


def check_stream_n2(url: str, base: str, adapter: Path) -> None:
    body = {
        "model": base,
        "messages": ASK,
        "max_tokens": 6,
        "logprobs": True,
        "return_token_ids": True,
        "n": 2,
        "stream": True,
        "temperature": 1.0,
        "seed": 1,
    }
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=120) as answer:
        chunks = _sse(answer)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1], roles
    assert all(len(c["choices"]) <= 1 for c in chunks), "a chunk with more than one choice"
    for index in (0, 1):
        ids = [
            t
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == index
            for t in c["choices"][0].get("token_ids") or ()
        ]
        entries = [
            e
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == index
            for e in (c["choices"][0].get("logprobs") or {}).get("content") or ()
        ]
        assert len(ids) == len(entries) > 0, (index, len(ids), len(entries))


def check_tool_call_fragments(url: str, base: str, adapter: Path) -> None:
    body = {
        "model": base,
        "messages": ASK,
        "tools": [TOOL],
        "tool_choice": "required",
        "max_tokens": 64,
        "stream": True,
        "temperature": 1.0,
        "seed": 1,
    }
    with requests.post(f"{url}/v1/chat/completions", json=body, stream=True, timeout=120) as answer:
        assert answer.status_code == 200, answer.text
        chunks = _sse(answer)
    fragments = [f for c in chunks if c["choices"] for f in c["choices"][0]["delta"].get("tool_calls") or ()]
    assert fragments, "no tool-call fragment streamed"
    first = fragments[0]
    assert first.get("id") and first.get("type") == "function" and first["function"].get("name") == "lookup", first
    from deploy.serving.gateway_record import ChoiceRecord

    record = ChoiceRecord(0)
    for f in fragments:
        record.add_call_fragment(f)
    (call,) = record.tool_calls
    json.loads(call["function"]["arguments"])  # the pieces join into the call's JSON arguments


CHECKS: list[Callable[[str, str, Path], None]] = [
    check_models,
    check_lora_endpoints,
    check_unknown_model,
    check_processed_logprobs,
    check_token_ids,
    check_stream_n2,
    check_tool_call_fragments,
]


def run(url: str, adapter: Path) -> int:
    base = next(m["id"] for m in requests.get(f"{url}/v1/models", timeout=30).json()["data"] if not m.get("parent"))
    failed = 0
    for check in CHECKS:
        try:
            check(url, base, adapter)
            print(f"PASS  {check.__name__}")
        except Exception as exc:  # noqa: BLE001 - every check runs; each failure is printed
            failed += 1
            print(f"FAIL  {check.__name__}: {type(exc).__name__}: {exc}")
    print(f"{len(CHECKS) - failed} passed, {failed} failed")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running vLLM's base URL")
    parser.add_argument("--adapter", type=Path, help="a LoRA adapter directory of its base model")
    parser.add_argument("--stub", action="store_true", help="check the stand-in, tests/support/vllm_stub.py")
    args = parser.parse_args()
    if args.stub:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.support.servers import InProcessServer
        from tests.support.vllm_stub import VllmStub

        stub = VllmStub(logprobs_mode="processed_logprobs")
        stub.tool_call = {"name": "lookup", "arguments": {"key": "k1"}}
        server = InProcessServer(stub.app)
        with tempfile.TemporaryDirectory() as adapter:
            (Path(adapter) / "adapter_config.json").write_text("{}")
            try:
                return run(server.url, Path(adapter))
            finally:
                server.stop()
    if not args.url or not args.adapter:
        parser.error("give --url and --adapter, or --stub")
    return run(args.url.rstrip("/"), args.adapter)


if __name__ == "__main__":
    sys.exit(main())
