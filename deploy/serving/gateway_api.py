"""`rtrl gateway`'s HTTP surface (deploy/serving/gateway.py holds its routing state and the events'
way out; see it for the whole design):

    POST /v1/chat/completions, /v1/completions   forwarded to the upstream (gateway_forward.py)
    GET  /v1/models                              the upstream's, as it lists them
    POST /v1/feedback, /v1/interactions          the application's events, with the gateway's token
    GET  /health, /metrics
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import requests
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from deploy.serving.gateway import Gateway, new_id
from deploy.serving.gateway_body import json_object
from deploy.serving.gateway_forward import forward
from deploy.serving.serve import header_id
from pipeline.core.types import SCHEMA_VERSION, FeedbackEvent, InteractionEvent, first_violation

router = APIRouter()


def create_gateway_app(gw: Gateway) -> FastAPI:
    """The routes below, in front of `gw`'s upstream (the app's state: one gateway per app)."""
    app = FastAPI(title="rtrl gateway")
    app.state.gateway = gw
    app.include_router(router)
    return app


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


@router.post("/v1/chat/completions")
async def chat(request: Request) -> Response:
    gw = _gateway(request)
    body = await json_object(request, gw.max_body_bytes, gw.body_timeout_s)
    if isinstance(body, Response):
        return body
    if not isinstance(body.get("messages"), list):
        return JSONResponse(
            {
                "error": {
                    "message": "messages: a list of chat messages is required",
                    "param": "messages",
                    "type": "invalid_request_error",
                }
            },
            400,
        )
    return await forward(gw, "/v1/chat/completions", body, request.headers, True)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    gw = _gateway(request)
    body = await json_object(request, gw.max_body_bytes, gw.body_timeout_s)
    if isinstance(body, Response):
        return body
    return await forward(gw, "/v1/completions", body, request.headers, False)


@router.get("/v1/models")
def models(request: Request) -> Response:
    gw = _gateway(request)
    try:
        answer = gw.http.get(f"{gw.upstream}/v1/models", timeout=gw.timeout_s)
    except requests.RequestException as exc:
        return JSONResponse(
            {
                "error": {
                    "message": f"the upstream {gw.upstream} is unreachable: {exc}",
                    "type": "upstream_unreachable",
                }
            },
            502,
        )
    return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))


def _not_kept() -> JSONResponse:
    """Never a 2xx for an event that was not kept: the spool is full while Kafka is away."""
    return JSONResponse(
        {
            "error": {
                "message": "the gateway cannot keep the event now (its spool is full while "
                "Kafka is away): send it again later",
                "type": "unavailable",
            }
        },
        503,
        headers={"Retry-After": "30"},
    )


def _refused(exc: ValidationError) -> Response:
    field, reason = first_violation(exc)
    return JSONResponse({"error": {"message": f"{field}: {reason}", "param": field}}, 422)


def _not_allowed(gw: Gateway, request: Request) -> JSONResponse | None:
    """The ingestion routes take events only with the gateway's token: anyone else could post
    feedback on another user's request, or an interaction under a request id of theirs."""
    if gw.ingest_token is None:
        return JSONResponse(
            {
                "error": {
                    "message": "event ingestion is off on this gateway: start it with "
                    "RTRL_GATEWAY_TOKEN set, and send that token as "
                    "'Authorization: Bearer <token>'",
                    "type": "forbidden",
                }
            },
            403,
        )
    if not gw.may_ingest(request.headers.get("authorization")):
        return JSONResponse(
            {
                "error": {
                    "message": "a valid 'Authorization: Bearer <token>' is required (the gateway's RTRL_GATEWAY_TOKEN)",
                    "type": "unauthorized",
                }
            },
            401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


async def _event_body(gw: Gateway, request: Request) -> dict[str, Any] | Response:
    """An ingestion route's body: refused without the token, then read within the gateway's
    size and time limits; a Response is the refusal to return."""
    if (refusal := _not_allowed(gw, request)) is not None:
        return refusal
    return await json_object(request, gw.max_body_bytes, gw.body_timeout_s)


@router.post("/v1/feedback")
async def feedback(request: Request) -> Response:
    gw = _gateway(request)
    body = await _event_body(gw, request)
    if isinstance(body, Response):
        return body
    try:
        ev = FeedbackEvent.model_validate(
            {
                "schema_version": SCHEMA_VERSION,
                "event_id": body.get("event_id") or new_id("gwf"),
                "type": "feedback",
                "ts": body.get("ts") or datetime.now(UTC),
                **{k: v for k, v in body.items() if k in ("request_id", "episode_id", "kind", "value", "payload")},
                # whose episode: the body's tenant, else X-Tenant (the header the calls carried); neither:
                # not named, as over Kafka -- the episode id in every tenant
                "tenant": body.get("tenant") or header_id(request.headers, "x-tenant"),
            }
        )
    except ValidationError as exc:
        return _refused(exc)
    if gw.subject(ev.request_id, ev.episode_id, ev.tenant or gw.default_tenant) not in gw.recent:
        gw.unknown.inc()
    if not await gw.emit("feedback", gw.emit_feedback, ev.to_wire()):
        return _not_kept()
    return JSONResponse(
        {"event_id": ev.event_id, **ev.model_dump(include={"request_id", "episode_id"}, exclude_none=True)}, 202
    )


@router.post("/v1/interactions")
async def interaction(request: Request) -> Response:
    """An interaction event of an application that serves its model itself (pipeline/client.py):
    validated against the contract and produced as sent."""
    gw = _gateway(request)
    body = await _event_body(gw, request)
    if isinstance(body, Response):
        return body
    try:
        ev = InteractionEvent.model_validate(body)
    except ValidationError as exc:
        return _refused(exc)
    if not await gw.emit("interaction", gw.emit_interaction, body):
        return _not_kept()
    gw.answered(ev.request_id, ev.episode_id, ev.tenant)
    return JSONResponse({"event_id": ev.event_id, "request_id": ev.request_id}, 202)


@router.get("/health")
def health(request: Request) -> dict[str, Any]:
    gw = _gateway(request)
    return {
        "status": "ok",
        "upstream": gw.upstream,
        "version": gw.champion or "base",  # as rtrl serve's
        "champion": gw.champion or "base",
        "canary": {"version": gw.canary, "share": gw.canary_share} if gw.canary else None,
    }


@router.get("/metrics")
def metrics(request: Request) -> Response:
    return Response(generate_latest(_gateway(request).metrics), media_type=CONTENT_TYPE_LATEST)
