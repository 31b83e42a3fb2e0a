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

import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from deploy.serving.serve import BASE, PolicyServer
from deploy.serving.serve_answers import chat_answer, completion_answer, streamed_answer
from deploy.serving.serve_requests import ChatRequest, CompletionRequest

router = APIRouter()


def create_app(server: PolicyServer) -> FastAPI:
    """The routes below, answering with `server` (the app's state: one server per app)."""
    app = FastAPI(title="rtrl reference policy server")
    app.state.server = server
    app.add_exception_handler(RequestValidationError, _invalid)  # type: ignore[arg-type]
    app.include_router(router)
    return app


def _server(request: Request) -> PolicyServer:
    return request.app.state.server


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": "invalid_request_error", "param": param}}, status_code=status
    )


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if p != "body")
    _server(request).requests.labels("any", "invalid").inc()
    if first["type"] == "extra_forbidden":
        return _error(400, f"{param} is not supported by rtrl serve; leave it out", param)
    if first["type"] == "value_error":  # our own refusals say it all
        return _error(400, first["msg"].removeprefix("Value error, "), param or None)
    return _error(400, f"{param}: {first['msg']}", param)


@router.post("/v1/completions")
def completions(req: CompletionRequest, request: Request) -> Response:
    server, headers = _server(request), dict(request.headers)
    if req.stream:
        return streamed_answer(server, req, req.prompt, None, None, headers, chat=False)
    answers = server.answer(req.prompt, req, headers)
    server.requests.labels("completions", "ok").inc()
    return completion_answer(server, req, answers)


@router.post("/v1/chat/completions")
def chat(req: ChatRequest, request: Request) -> Response:
    server, headers = _server(request), dict(request.headers)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    if req.stream:
        return streamed_answer(server, req, messages, req.tools, req.parse_tools(), headers, chat=True)
    answers = server.answer(messages, req, headers, tools=req.tools, parse_tools=req.parse_tools())
    server.requests.labels("chat", "ok").inc()
    return chat_answer(server, req, messages, answers)


@router.get("/v1/models")
def models(request: Request) -> dict[str, Any]:
    """What vLLM's /v1/models lists: the base model, and each adapter served by its versioned
    name with the base as its `parent` (the official client and most tools call this first)."""
    server = _server(request)
    created = int(time.time())
    card = {"object": "model", "created": created, "owned_by": "rtrl", "root": server.model_name}
    versions = [v for v in (server.version, server.canary) if v is not None and v != BASE]
    return {
        "object": "list",
        "data": [{"id": server.model_name, **card, "parent": None}]
        + [{"id": f"{server.model_name}-v{v}", **card, "parent": server.model_name} for v in versions],
    }


@router.get("/health")
def health(request: Request) -> dict[str, Any]:
    server = _server(request)
    out: dict[str, Any] = {"status": "ok", "model": server.model_name, "version": server.version}
    if server.canary is not None:
        out["canary"] = {"version": server.canary, "share": server.canary_share}
    return out


@router.get("/metrics")
def metrics(request: Request) -> Response:
    return Response(generate_latest(_server(request).metrics), media_type=CONTENT_TYPE_LATEST)
