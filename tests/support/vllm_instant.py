"""An OpenAI-compatible upstream that answers every chat request at once in vLLM's shape (the
answer of tests/support/fixtures/vllm_chat_completion.json: log-probs with token ids; streamed as one
chunk per token and [DONE]) -- a raw ASGI app, so that what a gateway in front of it costs is
what a benchmark measures (benchmarks/gateway.py) and a test's load is cheap. tests/support/vllm_stub.py
is the faithful stand-in."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURE = Path(__file__).parent / "fixtures" / "vllm_chat_completion.json"


def instant_vllm_app():
    """A raw ASGI app answering every chat request at once, vLLM-shaped."""
    answer = json.loads(FIXTURE.read_text())
    answer.pop("_source", None)
    body = json.dumps(answer).encode()
    entries = answer["choices"][0]["logprobs"]["content"]
    chunks = []
    for entry, token in zip(entries, answer["choices"][0]["token_ids"]):
        text = bytes(entry["bytes"]).decode()
        chunks.append(
            {
                "id": answer["id"],
                "object": "chat.completion.chunk",
                "created": answer["created"],
                "model": answer["model"],
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": text},
                        "logprobs": {"content": [entry]},
                        "finish_reason": None,
                        "token_ids": [token],
                    }
                ],
            }
        )
    chunks[-1]["choices"][0]["finish_reason"] = "length"
    stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        streamed = b'"stream": true' in raw or b'"stream":true' in raw
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream" if streamed else b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": stream if streamed else body})

    return app


async def read_body(receive) -> bytes:
    """A raw ASGI request's body, all of it."""
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            return raw
