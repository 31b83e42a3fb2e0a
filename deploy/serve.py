"""`rtrl serve`: a reference policy server for small models and the demo.

    POST /v1/completions        {"prompt", "max_tokens", "temperature", "top_p", "seed", "user"}
    POST /v1/chat/completions   {"messages": [...], same sampling fields}
    GET  /health                the version being served (and the canary, if one is staged)
    GET  /metrics               Prometheus: requests, latency, swaps, events not delivered

An OpenAI-compatible subset over the base model plus the champion adapter. Every response
carries the per-token log-probs of what was sampled (after temperature and top-p) and the
version that produced it (`model` = "<name>:<version>", header X-Rtrl-Policy-Version); every
request becomes an `interaction` event on Kafka with the same version as `policy_version`, so
the loop can learn from it. Headers X-Session-Id and X-Tenant fill the event.

Request ids: the server chooses every request's id (`req-<uuid>`: the response's `id` and its
X-Request-Id header; feedback names it). A client's own X-Request-Id is kept in the event as
`client_request_id`, never used as the id: a client could otherwise pick which side of a
canary answers it, or collide with another request's feedback.

Swapping: a model-update event loads the new adapter and switches to it under the model lock.
Generation holds the same lock, so a request in flight finishes on the version it started
with and the next one starts on the new version: nothing is dropped or failed by a swap.

Staged rollout: while the registry has a `canary`, the share of requests whose id hashes
below its share (deploy/rollout.py) are answered by the canary, the rest by the champion; each
interaction event names the version that answered, so the loop compares the two online.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from deploy.rollout import routes_to_canary
from pipeline.core.types import SCHEMA_VERSION, Identifier, InteractionEvent, Sampling

log = logging.getLogger("rtrl.serve")
BASE = "base"  # the version name of the base model with no adapter


class _Sampling(BaseModel):
    # A parameter the server does not implement is refused with a 400 naming it, never ignored:
    # ignoring `stream: true` or `n: 3` hands the client an answer of another shape than it
    # asked for (the official client then iterates an empty stream without an error).
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = Field(default=16, ge=1, le=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=4096)  # the newer name of max_tokens
    temperature: float = Field(default=1.0, ge=0.0, le=5.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    user: Identifier | None = None  # the event's user_id: an identifier (no NUL, not blank, <= 256)
    # accepted only at the value that asks for nothing more than what is served
    stream: bool = False
    n: int = 1
    logprobs: bool | int | None = None  # the answer always carries the sampled tokens' log-probs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    @field_validator("stream", "n", "presence_penalty", "frequency_penalty")
    @classmethod
    def _only_the_default(cls, value: Any, info: Any) -> Any:
        default = cls.model_fields[info.field_name].default
        if value != default:
            raise ValueError(f"{info.field_name}={value!r} is not supported by rtrl serve (only {default!r})")
        return value

    @model_validator(mode="after")
    def _one_length(self) -> "_Sampling":
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Sampling):
    prompt: str = Field(min_length=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id: kept by clients, not needed here

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)


class PolicyServer:
    """The model, the version it serves, and the lock that serialises generation and swaps."""

    def __init__(self, runner: Any, model_name: str, emit: Callable[[dict[str, Any]], None] | None = None,
                 default_tenant: str = "default", keep_versions: int = 3) -> None:
        self.runner, self.model_name, self.emit = runner, model_name, emit
        self.default_tenant, self.keep_versions = default_tenant, keep_versions
        self.version = BASE
        self.canary: str | None = None  # a staged candidate serving `canary_share` of requests
        self.canary_share = 0.0
        self.loaded: list[str] = []  # adapter versions in memory, oldest first
        self.lock = threading.Lock()
        self.metrics = CollectorRegistry()
        self.requests = Counter("rtrl_serve_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=self.metrics)
        self.latency = Histogram("rtrl_serve_latency_seconds", "Generation latency", registry=self.metrics)
        self.swaps = Counter("rtrl_serve_swaps", "Adapter swaps applied", registry=self.metrics)
        self.undelivered = Counter("rtrl_serve_events_undelivered", "Interaction events Kafka did not take",
                                   registry=self.metrics)
        self.serving = Gauge("rtrl_serve_version", "Registry version being served (0 = base)", registry=self.metrics)
        self.canary_version = Gauge("rtrl_serve_canary_version", "Registry version of the canary (0 = none)",
                                    registry=self.metrics)
        self.canary_share_gauge = Gauge("rtrl_serve_canary_share", "Share of requests routed to the canary",
                                        registry=self.metrics)

    def use(self, version: str, adapter_dir: Path | None) -> None:
        """Serve `version` (its adapter loaded from `adapter_dir`) from the next request on. A
        canary of the same version is done: it is the champion now."""
        with self.lock:
            if version == self.version:
                return
            self._load(version, adapter_dir)
            self.version = version
            if self.canary == version:
                self._set_canary(None, 0.0)
            self._evict()
            self.swaps.inc()
            self.serving.set(float(version) if version.isdigit() else 0.0)
        log.info("serving a new version", extra={"version": version})

    def stage(self, version: str | None, adapter_dir: Path | None, share: float) -> None:
        """Route `share` of requests to `version` from the next request on (None: no canary)."""
        with self.lock:
            if version is not None and version != self.version:
                self._load(version, adapter_dir)
                self._set_canary(version, share)
            else:
                self._set_canary(None, 0.0)
            self._evict()
        log.info("canary " + ("staged" if self.canary else "cleared"), extra={"version": version, "share": share})

    def _set_canary(self, version: str | None, share: float) -> None:
        self.canary, self.canary_share = version, share
        self.canary_version.set(float(version) if version and version.isdigit() else 0.0)
        self.canary_share_gauge.set(share)

    def _load(self, version: str, adapter_dir: Path | None) -> None:
        if adapter_dir is not None and version not in self.loaded:
            self.runner.add(version, adapter_dir)
            self.loaded.append(version)

    def _evict(self) -> None:
        # keep up to keep_versions adapters in memory: the champion, the canary and the newest
        # others (a rollback is then instant); drop the oldest others
        spare = [v for v in self.loaded if v not in (self.version, self.canary)]
        while len(self.loaded) > self.keep_versions and spare:
            victim = spare.pop(0)
            self.loaded.remove(victim)
            self.runner.remove(victim)

    def complete(self, prompt: Any, req: _Sampling, headers: dict[str, str]) -> tuple[Any, str, str]:
        request_id = f"req-{uuid.uuid4().hex}"  # routes the canary and joins feedback: never the client's
        with self.lock, self.latency.time():
            version = self.version
            if self.canary is not None and routes_to_canary(request_id, self.canary_share):
                version = self.canary
            gen = self.runner.generate(None if version == BASE else version, [prompt], max_new_tokens=req.max_tokens,
                                       temperature=req.temperature, top_p=req.top_p, seed=req.seed)[0]
        if self.emit is not None:
            self._emit(request_id, prompt, gen, version, req, headers)
        return gen, version, request_id

    def _emit(self, request_id: str, prompt: Any, gen: Any, version: str, req: _Sampling,
              headers: dict[str, str]) -> None:
        try:
            event = InteractionEvent(
                schema_version=SCHEMA_VERSION, event_id=f"srv-{uuid.uuid4().hex}", type="interaction",
                ts=datetime.now(timezone.utc), request_id=request_id,
                session_id=_header(headers, "x-session-id") or request_id, user_id=req.user or "anonymous",
                tenant=_header(headers, "x-tenant") or self.default_tenant, policy_version=version,
                prompt=prompt, completion=gen.text, completion_token_ids=gen.token_ids,
                behavior_logprobs=gen.logprobs,
                sampling=Sampling(temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens,
                                  seed=req.seed),
                latency_ms=round(gen.latency_ms, 3), metadata={"server": "rtrl-serve", "model": self.model_name},
                client_request_id=_header(headers, "x-request-id"))
            self.emit(event.to_wire())
        except Exception as exc:  # noqa: BLE001 - serving goes on; the loss is counted and logged
            self.undelivered.inc()
            log.error("interaction event not delivered", extra={"request_id": request_id, "error": str(exc)})


def _header(headers: dict[str, str], name: str) -> str | None:
    """A header as an event identifier: at most 256 characters, None when absent or blank."""
    value = (headers.get(name) or "")[:256]
    return value if value.strip() else None


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param}},
                        status_code=status)


def create_app(server: PolicyServer) -> FastAPI:
    app = FastAPI(title="rtrl reference policy server")

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body")
        server.requests.labels("any", "invalid").inc()
        if first["type"] == "extra_forbidden":
            return _error(400, f"{param} is not supported by rtrl serve; leave it out", param)
        if first["type"] == "value_error":  # our own refusals say it all
            return _error(400, first["msg"].removeprefix("Value error, "), param)
        return _error(400, f"{param}: {first['msg']}", param)

    def _tokens(gen: Any) -> list[str]:
        return [server.runner.tokenizer.decode([t]) for t in gen.token_ids]

    def _finish(gen: Any, req: _Sampling) -> str:
        return "stop" if gen.stopped else "length"

    def _usage(prompt: Any, gen: Any) -> dict[str, int]:
        prompt_tokens = server.runner.prompt_tokens(prompt) or 0
        return {"prompt_tokens": prompt_tokens, "completion_tokens": len(gen.token_ids),
                "total_tokens": prompt_tokens + len(gen.token_ids)}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest, request: Request) -> JSONResponse:
        gen, version, request_id = server.complete(req.prompt, req, dict(request.headers))
        server.requests.labels("completions", "ok").inc()
        body = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": f"{server.model_name}:{version}",
                "choices": [{"index": 0, "text": gen.text, "finish_reason": _finish(gen, req),
                             "logprobs": {"tokens": _tokens(gen), "token_logprobs": gen.logprobs,
                                          "token_ids": gen.token_ids}}],
                "usage": _usage(req.prompt, gen)}
        return JSONResponse(body, headers={"X-Rtrl-Policy-Version": version, "X-Request-Id": request_id})

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest, request: Request) -> JSONResponse:
        messages = [m.model_dump() for m in req.messages]
        gen, version, request_id = server.complete(messages, req, dict(request.headers))
        server.requests.labels("chat", "ok").inc()
        content = [{"token": tok, "logprob": lp, "token_id": tid}
                   for tok, lp, tid in zip(_tokens(gen), gen.logprobs, gen.token_ids)]
        body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": f"{server.model_name}:{version}",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                             "finish_reason": _finish(gen, req), "logprobs": {"content": content}}],
                "usage": _usage(messages, gen)}
        return JSONResponse(body, headers={"X-Rtrl-Policy-Version": version, "X-Request-Id": request_id})

    @app.get("/health")
    def health() -> dict[str, Any]:
        out: dict[str, Any] = {"status": "ok", "model": server.model_name, "version": server.version}
        if server.canary is not None:
            out["canary"] = {"version": server.canary, "share": server.canary_share}
        return out

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(server.metrics), media_type=CONTENT_TYPE_LATEST)

    return app
