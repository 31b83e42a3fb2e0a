"""Stand-ins for vLLM's OpenAI-compatible server, which cannot run on these CPU machines.

`VllmStub` implements the protocol of vLLM v0.34.0 (commit 62d4bc3c7), read from the source
files of its release (the `vllm==0.34.0` wheel: the repository's snapshot is over the size this
workplace fetches); each behaviour names the file it comes from (paths under vllm/entrypoints/):

    GET  /v1/models               openai/models/serving.py show_available_models: the base model
                                  (parent null), then every loaded LoRA adapter (parent: the base)
    POST /v1/load_lora_adapter    serve/lora/api_router.py, only with VLLM_ALLOW_RUNTIME_LORA_UPDATING:
                                  200 "Success: LoRA adapter 'X' added successfully." (plain text);
                                  400 InvalidUserInput when X is loaded already; 404 NotFoundError
                                  when the path holds no adapter_config.json; 500 when the engine fails
    POST /v1/unload_lora_adapter  200 "... removed successfully."; 404 when X is not loaded
    POST /v1/completions, /v1/chat/completions
        unknown `model`           404 NotFoundError "The model `X` does not exist." (param "model")
        omitted sampling fields   the model's generation_config defaults (`generation_defaults`),
                                  else temperature 1, top_p 1, top_k 0 (off), min_p 0, no penalties
        token ids                 `return_token_ids`: each choice's `token_ids` (streamed: each chunk's)
        log-probs                 `logprobs_mode`: "raw_logprobs" (vLLM's default: log_softmax of the
                                  model's logits) or "processed_logprobs" (after temperature, min_p,
                                  top-k, top-p: the distribution the token was drawn from; masked
                                  tokens -9999.0); tokens as "token_id:<id>" when asked, `bytes` the
                                  token's text (chat/completions' _create_chat_logprobs)
        n > 1                     choices by `index`; streamed, one choice per chunk: first a role
                                  chunk per choice, then the choices' deltas interleaved
        tool calls (hermes)       with `tools` and a scripted call: non-streamed message.tool_calls,
                                  content null, finish_reason "tool_calls"; streamed, the first
                                  fragment {id, type, index, function: {name}} (no arguments), then
                                  {index, function: {arguments: piece}}, each with "content": null,
                                  the name and the first piece sometimes in one chunk
                                  (tool_parsers/hermes_tool_parser.py extract_tool_calls_streaming)
        mid-stream failure        data: {"error": {"message", "type", "param", "code"}} then
                                  data: [DONE], the status already 200 (chat_completion/serving.py)

The model is a toy: 96 tokens (id 0 the end of the answer, ids 1-95 the printable ASCII
characters), its logits a hash of (model or adapter name, prompt, tokens so far). A scripted
call's tokens are its hermes text, forced, with their log-probs as the model gives them.

tests/support/vllm_instant.py answers every chat request at once with a fixed answer, for benchmarks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

VOCAB = 96  # 0: the end of the answer; i: chr(31 + i)
MASKED = -9999.0  # vLLM's value for a log-prob of -inf


def error(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse (serve/engine/protocol.py): nested, with the status as `code`."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def text_of(token: int) -> str:
    return "" if token == 0 else chr(31 + token)


def tokens_of(text: str) -> list[int]:
    return [ord(c) - 31 for c in text if 32 <= ord(c) < 127]


def logits(name: str, prompt: str, so_far: list[int]) -> list[float]:
    """The toy model's next-token logits: a hash of what it conditions on, spread ~N(0, 2)."""
    seed = hashlib.blake2b(f"{name}|{prompt}|{so_far}".encode(), digest_size=8).digest()
    rng = random.Random(seed)
    return [rng.gauss(0.0, 2.0) for _ in range(VOCAB)]


def log_softmax(values: list[float]) -> list[float]:
    top = max(values)
    total = math.log(sum(math.exp(v - top) for v in values if v != -math.inf))
    return [v - top - total if v != -math.inf else -math.inf for v in values]


def processed(raw: list[float], sp: dict[str, Any]) -> list[float]:
    """vLLM's processed logits (v1/worker/gpu/sample/sampler.py): temperature (skipped at 0 and
    1), then min_p, then top-k and top-p masking."""
    t = sp["temperature"]
    values = [v / t for v in raw] if t not in (0, 1) else list(raw)
    probs = [math.exp(v) for v in log_softmax(values)]
    if sp["min_p"] > 0:
        cut = sp["min_p"] * max(probs)
        values = [v if p >= cut else -math.inf for v, p in zip(values, probs)]
    order = sorted(range(VOCAB), key=lambda i: -values[i])
    keep = set(order[: sp["top_k"]] if sp["top_k"] > 0 else order)
    if sp["top_p"] < 1:
        mass, nucleus = 0.0, set()
        for i in order:
            if mass >= sp["top_p"]:
                break
            nucleus.add(i)
            mass += probs[i]
        keep &= nucleus
    return [v if i in keep else -math.inf for i, v in enumerate(values)]


@dataclass
class Choice:
    index: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    call: dict[str, Any] | None = None  # a scripted tool call: {"name", "arguments"}
    failed: bool = False

    @property
    def text(self) -> str:
        return "".join(text_of(t) for t in self.tokens)


class VllmStub:
    """vLLM v0.34.0's OpenAI-compatible server, as far as rtrl relies on it (see the module)."""

    def __init__(
        self,
        base: str = "base-model",
        logprobs_mode: str = "raw_logprobs",
        runtime_lora_updating: bool = True,
        generation_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.base, self.logprobs_mode, self.runtime = base, logprobs_mode, runtime_lora_updating
        self.defaults = generation_defaults or {}  # the model's generation_config.json (--generation-config auto)
        self.loras: dict[str, str] = {}  # lora_name -> lora_path
        self.requests: list[dict[str, Any]] = []  # every completion request's body, as received
        self.lora_calls: list[tuple[str, str, int]] = []  # (path, lora_name, status) of each LoRA call
        self.tool_call: dict[str, Any] | None = None  # what the model calls when tools are offered
        self.split_name_and_first_piece = False  # stream the name and the first piece in two chunks
        self.fail_after: int | None = None  # the engine fails after this many tokens of a stream
        self.fail_loads = 0  # the next loads fail in the engine (500)
        self._last_lora = ""
        self.app = self._app()

    def sampling(self, body: dict[str, Any]) -> dict[str, Any]:
        """Request value, else the model's generation_config, else vLLM's defaults
        (chat_completion/protocol.py to_sampling_params, _DEFAULT_SAMPLING_PARAMS)."""
        base = {
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
        }
        sp = {k: body[k] if body.get(k) is not None else self.defaults.get(k, v) for k, v in base.items()}
        sp["top_k"] = max(int(sp["top_k"]), 0)  # -1: off, as 0
        return sp

    def generate(self, name: str, prompt: str, body: dict[str, Any], index: int) -> Choice:
        sp = self.sampling(body)
        rng = random.Random(f"{body.get('seed') if body.get('seed') is not None else random.random()}|{index}")
        choice = Choice(index)
        forced = None
        if body.get("tools") and self.tool_call is not None and body.get("tool_choice") != "none":
            choice.call = self.tool_call
            forced = tokens_of(f"<tool_call>\n{json.dumps(self.tool_call)}\n</tool_call>") + [0]
        for step in range(int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)):
            raw = logits(name, prompt, choice.tokens)
            values = processed(raw, sp)
            if forced is not None:
                token = forced[step] if step < len(forced) else 0
            elif sp["temperature"] < 1e-5:
                token = max(range(VOCAB), key=lambda i: raw[i])
            else:
                probs = [math.exp(v) for v in log_softmax(values)]
                token = rng.choices(range(VOCAB), weights=probs)[0]
            scores = log_softmax(raw if self.logprobs_mode == "raw_logprobs" else values)
            if token == 0:
                break
            choice.tokens.append(token)
            choice.logprobs.append(max(scores[token], MASKED))
        return choice

    def entry(self, token: int, lp: float, as_ids: bool) -> dict[str, Any]:
        return {
            "token": f"token_id:{token}" if as_ids else text_of(token),
            "logprob": lp,
            "bytes": list(text_of(token).encode()),
            "top_logprobs": [],
        }

    def _app(self) -> FastAPI:
        app = FastAPI(title="vLLM v0.34.0 stand-in")

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            created = int(time.time())
            card = {"object": "model", "created": created, "owned_by": "vllm", "permission": []}
            return {
                "object": "list",
                "data": [{"id": self.base, **card, "root": self.base, "parent": None, "max_model_len": 4096}]
                + [
                    {"id": name, **card, "root": path, "parent": self.base, "max_model_len": None}
                    for name, path in self.loras.items()
                ],
            }

        @app.middleware("http")
        async def record(request: Request, call_next):
            response = await call_next(request)
            if "lora_adapter" in request.url.path:
                self.lora_calls.append((request.url.path, self._last_lora, response.status_code))
            return response

        @app.post("/v1/load_lora_adapter")
        async def load(request: Request) -> Response:
            if not self.runtime:
                return JSONResponse({"detail": "Not Found"}, 404)
            body = await request.json()
            name, path = body.get("lora_name") or "", body.get("lora_path") or ""
            self._last_lora = name
            if not name or not path:
                return JSONResponse(
                    error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400), 400
                )
            if name in self.loras and not body.get("load_inplace"):
                return JSONResponse(
                    error(
                        f"The lora adapter '{name}' has already been loaded. If you want to load "
                        "the adapter in place, set 'load_inplace' to True.",
                        "InvalidUserInput",
                        400,
                    ),
                    400,
                )
            if not (Path(path) / "adapter_config.json").exists():
                return JSONResponse(
                    error(f"Loading lora {name} failed: No adapter found for <path>", "NotFoundError", 404), 404
                )
            if self.fail_loads > 0:
                self.fail_loads -= 1
                return JSONResponse(
                    error(
                        "Call to add_lora method failed: Worker failed with error 'CUDA out of "
                        "memory', please check the stack trace above for the root cause",
                        "InternalServerError",
                        500,
                    ),
                    500,
                )
            self.loras[name] = path
            return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload(request: Request) -> Response:
            if not self.runtime:
                return JSONResponse({"detail": "Not Found"}, 404)
            name = (await request.json()).get("lora_name") or ""
            self._last_lora = name
            if name not in self.loras:
                return JSONResponse(error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404), 404)
            del self.loras[name]
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self.complete(await request.json(), chat=True)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self.complete(await request.json(), chat=False)

        return app

    async def complete(self, body: dict[str, Any], chat: bool) -> Response:
        self.requests.append(body)
        name = body.get("model") or self.base
        if name != self.base and name not in self.loras:
            return JSONResponse(
                error(f"The model `{name}` does not exist. Valid aliases: {self.base}.", "NotFoundError", 404, "model"),
                404,
            )
        prompt = json.dumps(body["messages"]) if chat else str(body.get("prompt"))
        choices = [self.generate(name, prompt, body, i) for i in range(int(body.get("n") or 1))]
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        with_ids = bool(body.get("return_token_ids"))  # each choice's (chunk's) `token_ids`
        want_lp = bool(body.get("logprobs")) if chat else body.get("logprobs") is not None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if body.get("stream"):
            return StreamingResponse(
                self.stream(rid, name, choices, chat, want_lp, as_ids, with_ids), media_type="text/event-stream"
            )
        out = []
        for c in choices:
            lp = None
            if want_lp and chat:
                lp = {"content": [self.entry(t, v, as_ids) for t, v in zip(c.tokens, c.logprobs)]}
            elif want_lp:
                toks = [f"token_id:{t}" if as_ids else text_of(t) for t in c.tokens]
                lp = {"text_offset": [], "token_logprobs": c.logprobs, "tokens": toks, "top_logprobs": None}
            if chat:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": None if c.call else c.text,
                    "refusal": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                }
                if c.call:
                    message["tool_calls"] = [
                        {
                            "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
                            "type": "function",
                            "function": {"name": c.call["name"], "arguments": json.dumps(c.call["arguments"])},
                        }
                    ]
                out.append(
                    {
                        "index": c.index,
                        "message": message,
                        "logprobs": lp,
                        "finish_reason": "tool_calls" if c.call else "stop",
                        "stop_reason": None,
                        "token_ids": c.tokens if with_ids else None,
                    }
                )
            else:
                out.append(
                    {
                        "index": c.index,
                        "text": c.text,
                        "logprobs": lp,
                        "finish_reason": "stop",
                        "stop_reason": None,
                        "token_ids": c.tokens if with_ids else None,
                    }
                )
        n_out = sum(len(c.tokens) for c in choices)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": name,
                "choices": out,
                "usage": {"prompt_tokens": 1, "total_tokens": 1 + n_out, "completion_tokens": n_out},
            }
        )

    async def stream(
        self, rid: str, name: str, choices: list[Choice], chat: bool, want_lp: bool, as_ids: bool, with_ids: bool
    ):
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": name,
        }

        def frame(choice: dict[str, Any]) -> str:
            return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

        if chat:
            for c in choices:
                yield frame(
                    {
                        "index": c.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                )
        longest = max(len(c.tokens) for c in choices)
        for step in range(longest):
            for c in choices:
                if step >= len(c.tokens):
                    continue
                if self.fail_after is not None and step >= self.fail_after:
                    yield f"data: {json.dumps(error('Internal server error', 'InternalServerError', 500))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                t, v = c.tokens[step], c.logprobs[step]
                if chat:
                    lp = {"content": [self.entry(t, v, as_ids)]} if want_lp else None
                    # a call's text is held back by the tool parser: its tokens' log-probs and ids
                    # still go out, with an empty delta (chat_completion/serving.py)
                    yield frame(
                        {
                            "index": c.index,
                            "delta": {} if c.call else {"content": text_of(t)},
                            "logprobs": lp,
                            "finish_reason": None,
                            "token_ids": [t] if with_ids else None,
                        }
                    )
                else:
                    lp = (
                        {
                            "text_offset": [0],
                            "token_logprobs": [v],
                            "tokens": [f"token_id:{t}" if as_ids else text_of(t)],
                            "top_logprobs": None,
                        }
                        if want_lp
                        else None
                    )
                    yield frame(
                        {
                            "index": c.index,
                            "text": text_of(t),
                            "logprobs": lp,
                            "finish_reason": None,
                            "token_ids": [t] if with_ids else None,
                        }
                    )
            await asyncio.sleep(0)
        for c in choices:
            if c.call:
                yield from_call(frame, c, self.split_name_and_first_piece)
        for c in choices:
            finish = "tool_calls" if c.call else "stop"
            yield frame(
                {
                    "index": c.index,
                    "delta": {"content": ""},
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
                if chat
                else {"index": c.index, "text": "", "logprobs": None, "finish_reason": finish, "stop_reason": None}
            )
        yield "data: [DONE]\n\n"


def from_call(frame, c: Choice, split: bool) -> str:
    """A scripted call's hermes fragments (tool_parsers/hermes_tool_parser.py): the name, then
    the arguments in three pieces."""
    args = json.dumps(c.call["arguments"])
    third = max(len(args) // 3, 1)
    pieces = [args[:third], args[third : 2 * third], args[2 * third :]]
    name = {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex[:8]}",
        "type": "function",
        "index": 0,
        "function": {"name": c.call["name"]},
    }
    first = [name] if split else [name, {"index": 0, "function": {"arguments": pieces.pop(0)}}]
    out = frame(
        {
            "index": c.index,
            "delta": {"content": None, "tool_calls": first},
            "logprobs": None,
            "finish_reason": None,
            "token_ids": None,
        }
    )
    for piece in pieces:
        out += frame(
            {
                "index": c.index,
                "delta": {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": piece}}]},
                "logprobs": None,
                "finish_reason": None,
                "token_ids": None,
            }
        )
    return out
