"""`rtrl gateway`: an OpenAI-compatible proxy in front of the model server a product already runs
(vLLM, SGLang, `rtrl serve`), so that its traffic feeds the loop without an event producer of
its own.

    POST /v1/chat/completions, /v1/completions   forwarded, streamed or not, tools passed through
    GET  /v1/models                               forwarded
    POST /v1/feedback                             an outcome: a feedback event (422 when it breaks the contract)
    GET  /health, /metrics

For each request the gateway:
    1. assigns the request id (X-Request-Id; a client's own is kept as `client_request_id`) and
       takes the episode id from X-Rtrl-Episode-Id
    2. routes it: `model` becomes the champion's LoRA name on the upstream (`<model>-v<version>`,
       as `rtrl serve --vllm` loads them), or the canary's for the canary's share of request ids;
       it follows the registry through the model-update events
    3. asks the upstream for what training needs -- the sampled tokens' log-probs and ids
       (`logprobs`, vLLM's `return_tokens_as_token_ids`) -- and gives the client the answer in
       the shape it asked for (log-probs only if it asked, tokens as text unless it asked for ids)
    4. after the answer (never in its path), sends the interaction event; a streamed answer's
       when the stream ends (marked truncated if the client left first). Events wait in the
       spool while Kafka is away (pipeline/core/spool.py).
An upstream error reaches the client as the upstream gave it (a 502 or 504 with the reason when
there was no answer at all), and no event is sent for a request that got no answer.

The vLLM fields relied on, as its OpenAI-compatible server defines them
(vllm/entrypoints/openai/protocol.py; version not pinned here): `logprobs` (chat: true;
completions: 0), `return_tokens_as_token_ids`, and in the answer `logprobs.content[].token` as
"token_id:<id>", `.logprob`, `.bytes` (chat) and `logprobs.tokens` / `token_logprobs` (completions).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from typing import Any

import requests
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import ValidationError

from deploy.rollout import routes_to_canary
from deploy.serve import header_id
from pipeline.core.types import SCHEMA_VERSION, FeedbackEvent, InteractionEvent, ModelUpdate, Sampling

log = logging.getLogger("rtrl.gateway")
Emit = Callable[[dict[str, Any]], None]


class Gateway:
    """The routing state (champion, canary) and the events' way out."""

    def __init__(self, upstream: str, model_name: str, emit_interaction: Emit | None, emit_feedback: Emit | None,
                 default_tenant: str = "default", timeout_s: float = 120.0) -> None:
        self.upstream, self.model_name, self.timeout_s = upstream.rstrip("/"), model_name, timeout_s
        self.emit_feedback, self.default_tenant = emit_feedback, default_tenant
        self.http = requests.Session()
        self.champion: str | None = None
        self.canary: str | None = None
        self.canary_share = 0.0
        self.recent: OrderedDict[str, None] = OrderedDict()  # request ids answered: feedback for others is counted
        self.metrics = CollectorRegistry()
        self.requests = Counter("rtrl_gateway_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=self.metrics)
        self.events = Counter("rtrl_gateway_events", "Events by type and outcome (sent, or lost: neither Kafka "
                              "nor the spool took it)", ["type", "outcome"], registry=self.metrics)
        self.unknown = Counter("rtrl_gateway_feedback_unknown_request", "Feedback for a request id this gateway "
                               "did not answer (accepted: the join handles any order)", registry=self.metrics)
        self.outbox: queue.Queue = queue.Queue()
        self.emit_interaction = emit_interaction
        threading.Thread(target=self._send_loop, name="gateway-events", daemon=True).start()

    def on_update(self, ev: ModelUpdate) -> None:
        """A model-update event, read back from the registry (deploy/follow.py)."""
        if ev.alias == "canary":
            self.canary, self.canary_share = ev.version, ev.share if ev.version else 0.0
        else:
            self.champion = ev.version
        log.info("routing updated", extra={"champion": self.champion, "canary": self.canary,
                                            "share": self.canary_share})

    def route(self, request_id: str) -> tuple[str, str | None]:
        """(the version that answers, its model name on the upstream; None: the base, as asked)."""
        version = self.champion
        if self.canary is not None and routes_to_canary(request_id, self.canary_share):
            version = self.canary
        return (version, f"{self.model_name}-v{version}") if version else ("base", None)

    def answered(self, request_id: str) -> None:
        self.recent[request_id] = None
        while len(self.recent) > 100_000:
            self.recent.popitem(last=False)

    def send_later(self, build: Callable[[], InteractionEvent]) -> None:
        """The event is built and sent off the answer's path, by the gateway's sender thread."""
        self.outbox.put(build)

    def _send_loop(self) -> None:
        while True:
            build = self.outbox.get()
            try:
                event = build().to_wire()
            except Exception as exc:  # noqa: BLE001 - what the upstream answered breaks the contract
                self.events.labels("interaction", "invalid").inc()
                log.error("interaction event not built", extra={"error": f"{type(exc).__name__}: {exc}"})
                continue
            self._emit("interaction", self.emit_interaction, event)

    def _emit(self, kind: str, emit: Emit | None, event: dict[str, Any]) -> None:
        if emit is None:
            return
        try:
            emit(event)
            self.events.labels(kind, "sent").inc()
        except Exception as exc:  # noqa: BLE001 - a full spool: counted and logged, the gateway goes on
            self.events.labels(kind, "lost").inc()
            log.error("event not delivered", extra={"type": kind, "request_id": event.get("request_id"),
                                                    "error": f"{type(exc).__name__}: {exc}"})


def _token_id(entry: dict[str, Any]) -> int | None:
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:"):
        return int(token.split(":", 1)[1])
    return entry.get("token_id")


def _as_asked(entries: list[dict[str, Any]], ids: bool) -> list[dict[str, Any]]:
    """Log-prob entries with tokens as the client asked: ids, or text (from the entry's bytes)."""
    if ids:
        return entries
    return [{**e, "token": bytes(e["bytes"]).decode(errors="replace") if e.get("bytes") is not None
             else e.get("token")} for e in entries]


def create_gateway_app(gw: Gateway) -> FastAPI:
    app = FastAPI(title="rtrl gateway")

    def event(request_id: str, version: str, body: dict[str, Any], headers: Any, completion: str,
              tool_calls: list | None, entries: list[dict[str, Any]], truncated: bool = False) -> InteractionEvent:
        ids = [_token_id(e) for e in entries]
        return InteractionEvent(
            schema_version=SCHEMA_VERSION, event_id=f"gw-{uuid.uuid4().hex}", type="interaction",
            ts=datetime.now(timezone.utc), request_id=request_id,
            session_id=header_id(headers, "x-session-id") or request_id, user_id=str(body.get("user") or "anonymous"),
            tenant=header_id(headers, "x-tenant") or gw.default_tenant, policy_version=version,
            prompt=body["messages"] if "messages" in body else body.get("prompt", ""), completion=completion,
            completion_token_ids=ids if entries and None not in ids else None,
            behavior_logprobs=[e["logprob"] for e in entries] if entries else None,
            sampling=Sampling(temperature=body.get("temperature", 1.0), top_p=body.get("top_p"),
                              top_k=body.get("top_k"), max_tokens=body.get("max_tokens"), seed=body.get("seed")),
            metadata={"server": "rtrl-gateway", "upstream": gw.upstream},
            client_request_id=header_id(headers, "x-request-id"), tools=body.get("tools"),
            tool_calls=tool_calls or None, episode_id=header_id(headers, "x-rtrl-episode-id"),
            truncated=truncated or None)

    def forward(path: str, request_body: dict[str, Any], headers: Any, chat: bool) -> Response:
        request_id = f"req-{uuid.uuid4().hex}"
        version, model = gw.route(request_id)
        asked_logprobs = bool(request_body.get("logprobs"))
        asked_ids = bool(request_body.get("return_tokens_as_token_ids"))
        up = {**request_body, "logprobs": True if chat else 0, "return_tokens_as_token_ids": True}
        if model is not None:
            up["model"] = model
        stream = bool(request_body.get("stream"))
        endpoint = "chat" if chat else "completions"
        try:
            answer = gw.http.post(f"{gw.upstream}{path}", json=up, stream=stream, timeout=gw.timeout_s,
                                  headers={"X-Request-Id": request_id})
        except requests.Timeout:
            gw.requests.labels(endpoint, "upstream_timeout").inc()
            return JSONResponse({"error": {"message": f"the upstream {gw.upstream} did not answer in "
                                                      f"{gw.timeout_s:g} s", "type": "upstream_timeout"}}, 504)
        except requests.RequestException as exc:
            gw.requests.labels(endpoint, "upstream_unreachable").inc()
            return JSONResponse({"error": {"message": f"the upstream {gw.upstream} is unreachable: {exc}",
                                           "type": "upstream_unreachable"}}, 502)
        if answer.status_code >= 400:  # the client gets the upstream's own error; no answer, no event
            gw.requests.labels(endpoint, "upstream_error").inc()
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        served = answer.headers.get("x-rtrl-policy-version") or version  # an rtrl serve upstream says
        out_headers = {"X-Request-Id": request_id, "X-Rtrl-Policy-Version": served}
        if stream:
            return StreamingResponse(relay(answer, request_id, served, request_body, headers, chat, asked_logprobs,
                                           asked_ids), media_type="text/event-stream", headers=out_headers)
        data = answer.json()
        gw.requests.labels(endpoint, "ok").inc()
        gw.answered(request_id)
        for choice in data.get("choices", []):
            lp = choice.get("logprobs") or {}
            if chat:
                entries = lp.get("content") or []
                message = choice.get("message") or {}
                completion, calls = message.get("content") or "", message.get("tool_calls")
            else:
                entries = [{"token": t, "logprob": v} for t, v in zip(lp.get("tokens") or [],
                                                                       lp.get("token_logprobs") or [])]
                completion, calls = choice.get("text") or "", None
            gw.send_later(lambda: event(request_id, served, request_body, headers, completion, calls, entries))
            if not asked_logprobs:
                choice.pop("logprobs", None)
            elif chat:
                choice["logprobs"] = {"content": _as_asked(entries, asked_ids)}
        data["id"] = request_id
        return JSONResponse(data, headers=out_headers)

    def relay(answer: requests.Response, request_id: str, version: str, body: dict[str, Any], headers: Any,
              chat: bool, asked_logprobs: bool, asked_ids: bool) -> Iterator[bytes]:
        """The upstream's chunks to the client, as asked; the event once the stream ends."""
        text, calls, entries, done = [], {}, [], False
        try:
            for line in answer.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: "):]
                if payload == b"[DONE]":
                    done = True
                    yield b"data: [DONE]\n\n"
                    break
                chunk = json.loads(payload)
                chunk["id"] = request_id
                for choice in chunk.get("choices", []):
                    lp = choice.get("logprobs") or {}
                    if chat:
                        delta = choice.get("delta") or {}
                        text.append(delta.get("content") or "")
                        for tc in delta.get("tool_calls") or ():
                            calls.setdefault(tc.get("index", 0), tc)
                        entries.extend(lp.get("content") or [])
                    else:
                        text.append(choice.get("text") or "")
                        entries.extend({"token": t, "logprob": v} for t, v in zip(lp.get("tokens") or [],
                                                                                  lp.get("token_logprobs") or []))
                    if not asked_logprobs:
                        choice.pop("logprobs", None)
                    elif chat and lp.get("content"):
                        choice["logprobs"] = {"content": _as_asked(lp["content"], asked_ids)}
                yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        finally:
            answer.close()
            gw.requests.labels("chat" if chat else "completions", "ok" if done else "disconnected").inc()
            if entries or text:
                gw.answered(request_id)
                gw.send_later(lambda: event(request_id, version, body, headers, "".join(text),
                                            [calls[k] for k in sorted(calls)], entries, truncated=not done))

    async def json_object(request: Request) -> dict[str, Any] | None:
        try:
            body = await request.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    def not_json() -> JSONResponse:
        return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                       "type": "invalid_request_error"}}, 400)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await json_object(request)
        if body is None or not isinstance(body.get("messages"), list):
            return not_json() if body is None else JSONResponse(
                {"error": {"message": "messages: a list of chat messages is required", "param": "messages",
                           "type": "invalid_request_error"}}, 400)
        return await _in_thread(forward, "/v1/chat/completions", body, request.headers, True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await json_object(request)
        if body is None:
            return not_json()
        return await _in_thread(forward, "/v1/completions", body, request.headers, False)

    @app.get("/v1/models")
    def models() -> Response:
        answer = gw.http.get(f"{gw.upstream}/v1/models", timeout=gw.timeout_s)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    @app.post("/v1/feedback")
    async def feedback(request: Request) -> Response:
        body = await json_object(request)
        if body is None:
            return not_json()
        try:
            ev = FeedbackEvent.model_validate({
                "schema_version": SCHEMA_VERSION, "event_id": body.get("event_id") or f"gwf-{uuid.uuid4().hex}",
                "type": "feedback", "ts": body.get("ts") or datetime.now(timezone.utc), **{
                    k: v for k, v in body.items() if k in ("request_id", "kind", "value", "payload")}})
        except ValidationError as exc:
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"])
            return JSONResponse({"error": {"message": f"{field}: {first['msg']}", "param": field}}, 422)
        if ev.request_id not in gw.recent:
            gw.unknown.inc()
        gw._emit("feedback", gw.emit_feedback, ev.model_dump(mode="json", exclude_none=True))
        return JSONResponse({"event_id": ev.event_id, "request_id": ev.request_id}, 202)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "upstream": gw.upstream, "champion": gw.champion or "base",
                "canary": {"version": gw.canary, "share": gw.canary_share} if gw.canary else None}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(gw.metrics), media_type=CONTENT_TYPE_LATEST)

    return app


async def _in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """A blocking upstream call off the event loop (the request's JSON body is read first, on it)."""
    return await asyncio.to_thread(fn, *args)
