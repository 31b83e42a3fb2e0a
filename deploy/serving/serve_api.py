"""rtrl serve's HTTP surface, OpenAI-compatible: the requests it accepts and the answers it gives.

    POST /v1/completions        {"prompt", "max_tokens", "temperature", "top_p", "seed", "user", "n", "stream"}
    POST /v1/chat/completions   {"messages", "tools", "tool_choice", same sampling fields}
    GET  /v1/models             the base model and the adapters served (vLLM's shape)
    GET  /health                the version being served (and the canary, if one is staged)
    GET  /metrics               Prometheus: requests, latency, swaps, events not delivered

Every answer carries the per-token log-probs of what was sampled and its token ids (`token_id`,
an rtrl extension), `usage`, and the version that produced it (header X-Rtrl-Policy-Version).

Tools: `tools` (OpenAI function schemas) are rendered by the model's chat template; tool calls
the model writes are parsed (pipeline/core/chat.py) into `message.tool_calls` with
`finish_reason: "tool_calls"`. A call that does not parse, names no offered tool or breaks the
tool's schema is returned as the model wrote it (as content), and the interaction event flags
it for the reward guards and the gate. `tool_choice`: "auto" or "none".

`n` > 1: each choice is its own request (its own `request_id` on the choice, its own event),
the siblings sharing the event's `group_id`. `stream: true`: server-sent events in OpenAI's
chunk format, each token as it is sampled, then `[DONE]`; tool-call text is held back until it
parses (then sent as tool-call deltas) or does not (then sent as content). The interaction event
is kept before the stream's [DONE]; a client that goes away stops the generation, and the event is
marked `truncated` (training skips it). A request a gateway in front routed (signed) sends no
event of its own: the gateway records it. A parameter the server does not implement is refused
with a 400 that names it, never ignored: ignoring `stream` or `n` hands the client an answer of
another shape than it asked for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deploy.serving.serve import BASE, Answer, PolicyServer, header_id, new_request_id
from pipeline.core.chat import held_back
from pipeline.core.types import Identifier

log = logging.getLogger("rtrl.serve")


class ClosingStreamingResponse(StreamingResponse):
    """A streamed response that closes its body generator however the response ends. When the
    client goes away, Starlette's send raises (ClientDisconnect) outside the generator, which
    stays suspended at a `yield`: its `finally` -- where the stream's interaction event is sent,
    marked truncated -- would wait for the garbage collector (a test saw no event after 30 s)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = Field(default=16, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    user: Identifier | None = None  # the event's user_id: an identifier (no NUL, not blank, <= 256)
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict[str, Any] | None = None  # {"include_usage": true}: a last chunk with usage
    logprobs: bool | int | None = None  # the answer always carries the sampled tokens' log-probs
    top_logprobs: int | None = Field(default=None, ge=0, le=0)  # only the sampled token's (0), as vLLM's default
    return_tokens_as_token_ids: bool = False  # vLLM's: each token as "token_id:<id>" (and its bytes)
    return_token_ids: bool = False  # vLLM's: each choice's (each chunk's) sampled token ids as `token_ids`
    # accepted only at the value that asks for nothing more than what is served
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's, as `rtrl gateway` sends it explicitly
    min_p: float = 0.0
    top_k: int = -1  # off: -1 or 0 (vLLM's conventions)

    @field_validator("top_k")
    @classmethod
    def _no_top_k(cls, value: int) -> int:
        if value > 0:
            raise ValueError(f"top_k={value!r} is not supported by rtrl serve (only -1 or 0: off)")
        return value

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")
    @classmethod
    def _only_the_default(cls, value: Any, info: Any) -> Any:
        default = cls.model_fields[info.field_name].default
        if value != default:
            raise ValueError(f"{info.field_name}={value!r} is not supported by rtrl serve (only {default!r})")
        return value

    @model_validator(mode="after")
    def _checked(self) -> _Sampling:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        if self.stream and self.n > 1:
            raise ValueError("n > 1 with stream=True is not supported by rtrl serve: stream one choice per request")
        return self


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # `name` and the like: kept by clients, not rendered

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    @model_validator(mode="after")
    def _content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's tool calls may stand alone)")
        return self


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | None = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, value: Any) -> Any:
        if value is not None and value not in ("auto", "none"):
            raise ValueError(
                f"tool_choice={value!r} is not supported by rtrl serve (only 'auto' or 'none': "
                "it cannot force the model to call a tool)"
            )
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: Any) -> Any:
        for tool in tools or ():
            fn = tool.get("function") if tool.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(
                    'each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'
                )
        return tools

    def parse_tools(self) -> list[dict[str, Any]] | None:
        """The tools whose calls are parsed out of the answer (none with tool_choice "none")."""
        return self.tools if self.tools and self.tool_choice != "none" else None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": param}}, status_code=status
    )


def create_app(server: PolicyServer) -> FastAPI:
    app = FastAPI(title="rtrl reference policy server")
    tok = server.runner.tokenizer

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body")
        server.requests.labels("any", "invalid").inc()
        if first["type"] == "extra_forbidden":
            return _error(400, f"{param} is not supported by rtrl serve; leave it out", param)
        if first["type"] == "value_error":  # our own refusals say it all
            return _error(400, first["msg"].removeprefix("Value error, "), param or None)
        return _error(400, f"{param}: {first['msg']}", param)

    def usage(prompt: Any, tools: Any, answers: list[Answer]) -> dict[str, int]:
        prompt_tokens = server.runner.prompt_tokens(prompt, tools) or 0
        completion = sum(len(a.gen.token_ids) for a in answers)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def headers(answers: list[Answer]) -> dict[str, str]:
        return {"X-Rtrl-Policy-Version": answers[0].version, "X-Request-Id": answers[0].request_id}

    def message(a: Answer) -> tuple[dict[str, Any], str]:
        if a.calls is not None and a.calls.valid:
            return {"role": "assistant", "content": a.calls.content, "tool_calls": a.calls.calls}, "tool_calls"
        return {"role": "assistant", "content": a.gen.text}, a.finish

    def token_name(t: int, as_ids: bool) -> str:
        return f"token_id:{t}" if as_ids else tok.decode([t])

    def token_logprobs(token_ids: list[int], logprobs: list[float], as_ids: bool = False) -> list[dict[str, Any]]:
        return [
            {"token": token_name(t, as_ids), "logprob": lp, "token_id": t, "bytes": list(tok.decode([t]).encode())}
            for t, lp in zip(token_ids, logprobs)
        ]

    @app.post("/v1/completions")
    def completions(req: CompletionRequest, request: Request) -> Response:
        if req.stream:
            return _stream(req, req.prompt, None, None, dict(request.headers), chat=False)
        answers = server.answer(req.prompt, req, dict(request.headers))
        server.requests.labels("completions", "ok").inc()
        body = {
            "id": answers[0].request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": f"{server.model_name}:{answers[0].version}",
            "choices": [
                {
                    "index": i,
                    "request_id": a.request_id,
                    "text": a.gen.text,
                    "finish_reason": a.finish,
                    "logprobs": {
                        "tokens": [token_name(t, req.return_tokens_as_token_ids) for t in a.gen.token_ids],
                        "token_logprobs": a.gen.logprobs,
                        "token_ids": a.gen.token_ids,
                    },
                    "token_ids": a.gen.token_ids if req.return_token_ids else None,
                }
                for i, a in enumerate(answers)
            ],
            "usage": usage(req.prompt, None, answers),
        }
        return JSONResponse(body, headers=headers(answers))

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest, request: Request) -> Response:
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        if req.stream:
            return _stream(req, messages, req.tools, req.parse_tools(), dict(request.headers), chat=True)
        answers = server.answer(messages, req, dict(request.headers), tools=req.tools, parse_tools=req.parse_tools())
        server.requests.labels("chat", "ok").inc()
        choices = []
        for i, a in enumerate(answers):
            msg, finish = message(a)
            choices.append(
                {
                    "index": i,
                    "request_id": a.request_id,
                    "message": msg,
                    "finish_reason": finish,
                    "logprobs": {
                        "content": token_logprobs(a.gen.token_ids, a.gen.logprobs, req.return_tokens_as_token_ids)
                    },
                    "token_ids": a.gen.token_ids if req.return_token_ids else None,
                }
            )
        body = {
            "id": answers[0].request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": f"{server.model_name}:{answers[0].version}",
            "choices": choices,
            "usage": usage(messages, req.tools, answers),
        }
        return JSONResponse(body, headers=headers(answers))

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        """What vLLM's /v1/models lists: the base model, and each adapter served by its versioned
        name with the base as its `parent` (the official client and most tools call this first)."""
        created = int(time.time())
        card = {"object": "model", "created": created, "owned_by": "rtrl", "root": server.model_name}
        versions = [v for v in (server.version, server.canary) if v is not None and v != BASE]
        return {
            "object": "list",
            "data": [{"id": server.model_name, **card, "parent": None}]
            + [{"id": f"{server.model_name}-v{v}", **card, "parent": server.model_name} for v in versions],
        }

    @app.get("/health")
    def health() -> dict[str, Any]:
        out: dict[str, Any] = {"status": "ok", "model": server.model_name, "version": server.version}
        if server.canary is not None:
            out["canary"] = {"version": server.canary, "share": server.canary_share}
        return out

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(server.metrics), media_type=CONTENT_TYPE_LATEST)

    def _stream(
        req: _Sampling, prompt: Any, tools: Any, parse: Any, request_headers: dict[str, str], chat: bool
    ) -> StreamingResponse:
        """Generation in a thread, its tokens through a queue to the client as server-sent events;
        the event once the stream ends (truncated if the client went away first)."""
        tokens: queue.Queue = queue.Queue()
        stop, result = threading.Event(), {"id": new_request_id()}
        # chosen now, so that the response's headers can say which version answers
        version = server.choose(
            req.model, request_headers, header_id(request_headers, "x-rtrl-episode-id") or result["id"]
        )

        def work() -> None:
            try:
                result["answer"] = server.answer(
                    prompt,
                    req,
                    request_headers,
                    tools=tools,
                    parse_tools=parse,
                    on_token=lambda t, lp: tokens.put((t, lp)),
                    stop=stop,
                    send_event=False,
                    request_id=result["id"],
                    version=version,
                )[0]
            except Exception as exc:  # noqa: BLE001 - reported to the client as an error chunk, and logged:
                # the client may be gone already, and nothing else would say it failed
                log.error("a streamed answer failed", extra={"request_id": result["id"], "error": repr(exc)})
                result["error"] = exc
            tokens.put(None)

        worker = threading.Thread(target=work, name="stream", daemon=True)
        worker.start()
        kind = "chat.completion.chunk" if chat else "text_completion"
        created, name = int(time.time()), server.model_name

        def chunk(choice: dict[str, Any], **extra: Any) -> str:
            body = {
                "id": result["id"],
                "object": kind,
                "created": created,
                "model": name,
                "choices": [{"index": 0, **choice}],
                **extra,
            }
            return f"data: {json.dumps(body)}\n\n"

        async def events() -> AsyncIterator[str]:
            finished, kept, ids, text, sent = False, False, [], "", 0
            try:
                if chat:
                    yield chunk(
                        {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    )
                while (item := await asyncio.to_thread(tokens.get)) is not None:
                    token, lp = item
                    ids.append(token)
                    text = tok.decode([t for t in ids if t != tok.eos_token_id])
                    # tool-call text is held back until the answer is whole: it parses or it does not
                    safe = held_back(text) if parse else len(text)
                    piece, sent = text[sent : max(safe, sent)], max(safe, sent)
                    entry = {
                        "token": token_name(token, req.return_tokens_as_token_ids),
                        "logprob": lp,
                        "token_id": token,
                        "bytes": list(tok.decode([token]).encode()),
                    }
                    ids_now = [token] if req.return_token_ids else None
                    if chat:
                        yield chunk(
                            {
                                "delta": {"content": piece},
                                "logprobs": {"content": [entry]},
                                "finish_reason": None,
                                "token_ids": ids_now,
                            }
                        )
                    else:
                        yield chunk(
                            {
                                "text": piece,
                                "logprobs": {"tokens": [entry["token"]], "token_logprobs": [lp], "token_ids": [token]},
                                "finish_reason": None,
                                "token_ids": ids_now,
                            }
                        )
                if "error" in result:
                    yield f"data: {json.dumps({'error': {'message': str(result['error'])}})}\n\n"
                    return
                a = result["answer"]
                finish = a.finish
                if a.calls is not None and a.calls.valid:
                    finish = "tool_calls"
                    yield chunk(
                        {
                            "delta": {"tool_calls": [{"index": i, **c} for i, c in enumerate(a.calls.calls)]},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                elif sent < len(a.gen.text):  # held back, and not a tool call after all: content
                    rest = a.gen.text[sent:]
                    yield chunk(
                        {"delta": {"content": rest}, "logprobs": None, "finish_reason": None}
                        if chat
                        else {"text": rest, "logprobs": None, "finish_reason": None}
                    )
                last = (
                    {"delta": {}, "logprobs": None, "finish_reason": finish}
                    if chat
                    else {"text": "", "logprobs": None, "finish_reason": finish}
                )
                include_usage = bool((req.stream_options or {}).get("include_usage"))
                yield chunk(last, **({"usage": usage(prompt, tools, [a])} if include_usage else {}))
                # the event kept before the client hears the end (the spool's append, in a thread):
                # a server killed once the client has its answer has kept its event
                kept = True
                await asyncio.to_thread(server.send_event, a, prompt, req, request_headers, tools)
                yield "data: [DONE]\n\n"
                finished = True
            finally:
                if not finished:
                    stop.set()  # the client went away: generation ends at its next token

                def send() -> None:  # off the event loop, which a cancelled stream cannot wait on here
                    worker.join(timeout=300)
                    if "answer" in result and not kept:  # truncated: the client left before the end
                        server.send_event(result["answer"], prompt, req, request_headers, tools, truncated=True)
                    outcome = "ok" if finished else "error" if "error" in result else "disconnected"
                    server.requests.labels("chat" if chat else "completions", outcome).inc()

                threading.Thread(target=send, name="stream-event", daemon=True).start()

        return ClosingStreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"X-Request-Id": result["id"], "X-Rtrl-Policy-Version": version},
        )

    return app
