"""What `rtrl gateway` does with one request (deploy/serving/gateway_api.py's routes): route it,
forward it to the upstream with what training needs asked of it, give the client the answer as it
asked for it, and keep one interaction event per choice before the answer's end is given.

    forward   route (gw.route_side: the router decides, never the client), ask the upstream for
              log-probs and token ids always, with the sampling it will use written out
              (upstream_sampling); a 404 for an adapter unloaded since the last poll: routes read
              anew, sent once more; the upstream's own errors to the client, with no event
    relay     a stream, chunk by chunk as the client asked; the events once it ends, marked
              truncated when the client left first or the upstream failed mid-stream
    keep_all  one event per choice, under its own request id, through the gateway's spool

See deploy/serving/gateway.py for the whole design.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson
from fastapi.responses import JSONResponse, Response

from deploy.serving.gateway import Gateway, new_id
from deploy.serving.gateway_record import AnswerRecord, ChoiceRecord, choice_index
from deploy.serving.gateway_sampling import logprobs_kept, upstream_sampling
from deploy.serving.routing import routing_signature
from deploy.serving.serve import header_id, header_step
from deploy.serving.serve_answers import ClosingStreamingResponse
from pipeline.core.types import SCHEMA_VERSION, InteractionEvent, Sampling

log = logging.getLogger("rtrl.gateway")


def _as_asked(entries: list[dict[str, Any]], ids: bool) -> list[dict[str, Any]]:
    """Log-prob entries with tokens as the client asked: an upstream that gives "token_id:<id>"
    tokens anyway (a server flag) has them read back as text from the entry's bytes."""
    if ids:
        return entries
    return [
        {**e, "token": bytes(e["bytes"]).decode(errors="replace")}
        if str(e.get("token")).startswith("token_id:") and e.get("bytes") is not None
        else e
        for e in entries
    ]


def _error_frame(message: str, kind: str, code: int) -> bytes:
    """A server-sent error, as vLLM writes one mid-stream (the openai client raises it)."""
    return b"data: " + orjson.dumps({"error": {"message": message, "type": kind, "code": code}}) + b"\n\n"


def _event(
    gw: Gateway,
    request_id: str,
    version: str,
    body: dict[str, Any],
    sent: dict[str, Any],
    headers: Any,
    record: ChoiceRecord,
    group_id: str | None,
    error: dict[str, Any] | None = None,
    truncated: bool = False,
) -> InteractionEvent:
    entries, ids = record.entries, record.token_ids
    metadata: dict[str, Any] = {"server": "rtrl-gateway", "upstream": gw.upstream}
    dropped = logprobs_kept(gw.logprobs_mode, body, sent)
    if dropped is not None and entries:
        metadata["behavior_logprobs_dropped"] = dropped
    if error is not None:
        metadata["upstream_error"] = str(error.get("message"))[:500]
    return InteractionEvent(
        schema_version=SCHEMA_VERSION,
        event_id=new_id("gw"),
        type="interaction",
        ts=datetime.now(UTC),
        request_id=request_id,
        session_id=header_id(headers, "x-session-id") or request_id,
        user_id=str(body.get("user") or "anonymous"),
        tenant=header_id(headers, "x-tenant") or gw.default_tenant,
        policy_version=version,
        prompt=body["messages"] if "messages" in body else body.get("prompt", ""),
        completion=record.completion,
        completion_token_ids=ids,
        behavior_logprobs=[e["logprob"] for e in entries] if entries and dropped is None else None,
        sampling=Sampling(
            temperature=sent["temperature"],
            top_p=sent["top_p"],
            top_k=sent["top_k"],
            max_tokens=body.get("max_tokens"),
            seed=body.get("seed"),
        ),
        metadata=metadata,
        client_request_id=header_id(headers, "x-request-id"),
        tools=body.get("tools"),
        tool_calls=record.tool_calls,
        group_id=group_id,
        episode_id=header_id(headers, "x-rtrl-episode-id"),
        step=header_step(headers),
        truncated=truncated or error is not None or None,
    )


def _upstream_failed(gw: Gateway, endpoint: str, status: int, kind: str, what: str) -> JSONResponse:
    """The client's error when the upstream did not give a usable answer (`kind` is also the
    outcome counted): no answer, so no event."""
    gw.requests.labels(endpoint, kind).inc()
    return JSONResponse({"error": {"message": f"the upstream {gw.upstream} {what}", "type": kind}}, status)


async def keep_all(
    gw: Gateway,
    answer: AnswerRecord,
    version: str,
    body: dict[str, Any],
    sent: dict[str, Any],
    headers: Any,
    truncated: bool = False,
) -> None:
    """One event per choice, each under its own request id, kept before the answer's end is given."""
    episode, tenant = header_id(headers, "x-rtrl-episode-id"), header_id(headers, "x-tenant") or gw.default_tenant
    for request_id, record in answer.records():
        gw.answered(request_id, episode, tenant)
        await gw.keep(
            functools.partial(
                _event, gw, request_id, version, body, sent, headers, record, answer.group_id, answer.error, truncated
            )
        )


async def forward(
    gw: Gateway, path: str, request_body: dict[str, Any], headers: Any, chat: bool, retry: bool = True
) -> Response:
    request_id = new_id("req")
    version, model, routed = gw.route_side(header_id(headers, "x-rtrl-episode-id") or request_id)
    asked_logprobs = bool(request_body.get("logprobs"))
    asked_ids = bool(request_body.get("return_tokens_as_token_ids"))
    asked_token_ids = bool(request_body.get("return_token_ids"))
    sent = upstream_sampling(request_body)  # what sampled the tokens, sent and recorded
    # log-probs always (a completion's top-N as the client asked), the sampled ids always (vLLM's
    # `token_ids`: the log-probs' tokens stay text, top-N alternatives included, unless asked)
    asked_top = request_body.get("logprobs") if isinstance(request_body.get("logprobs"), int) else None
    up = {**request_body, **sent, "logprobs": True if chat else max(asked_top or 0, 0), "return_token_ids": True}
    # the router decides which version answers, never the client: the base by its own name
    if model is None and gw.base_model is not None:
        model = gw.base_model
    elif model is None and str(request_body.get("model") or "").startswith(f"{gw.model_name}-v"):
        gw.requests.labels("chat" if chat else "completions", "refused").inc()
        return JSONResponse(
            {
                "error": {
                    "message": f"model {request_body['model']!r} names a version: the "
                    "gateway decides which version answers",
                    "param": "model",
                    "type": "invalid_request_error",
                }
            },
            400,
        )
    if model is not None:
        up["model"] = model
    stream = bool(request_body.get("stream"))
    endpoint = "chat" if chat else "completions"
    try:
        # X-Rtrl-Routed: the choice made, for an upstream that routes canaries itself (rtrl
        # serve: it follows the choice only with the signature of the shared routing secret);
        # vLLM goes by the adapter `model` names
        answer = await (await gw.session()).post(
            f"{gw.upstream}{path}",
            data=orjson.dumps(up),
            headers={
                "X-Request-Id": request_id,
                "Content-Type": "application/json",
                "X-Rtrl-Routed": routed,
                "X-Rtrl-Routed-Signature": routing_signature(gw.routing_secret, request_id, routed, up.get("model")),
            },
        )
    except TimeoutError:
        return _upstream_failed(gw, endpoint, 504, "upstream_timeout", f"did not answer in {gw.timeout_s:g} s")
    except aiohttp.ClientError as exc:
        return _upstream_failed(gw, endpoint, 502, "upstream_unreachable", f"is unreachable: {exc}")
    if answer.status == 404 and model is not None and retry:
        # the adapter routed to is gone (unloaded before the last poll saw it): routes read
        # anew, the request sent once more on them
        answer.close()
        await asyncio.to_thread(gw.reconcile)
        return await forward(gw, path, request_body, headers, chat, retry=False)
    if answer.status >= 400:  # the client gets the upstream's own error; no answer, no event
        gw.requests.labels(endpoint, "upstream_error").inc()
        async with answer:
            return Response(await answer.read(), answer.status, media_type=answer.headers.get("content-type"))
    served = answer.headers.get("x-rtrl-policy-version") or version  # an rtrl serve upstream says
    out_headers = {"X-Request-Id": request_id, "X-Rtrl-Policy-Version": served}
    record = AnswerRecord(request_id, lambda: new_id("req"))
    if stream:
        return ClosingStreamingResponse(
            relay(gw, answer, record, served, request_body, sent, headers, chat, asked_logprobs, asked_ids),
            media_type="text/event-stream",
            headers=out_headers,
        )
    try:
        async with answer:
            data = orjson.loads(await answer.read())
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an object")
    except TimeoutError:
        return _upstream_failed(
            gw, endpoint, 504, "upstream_timeout", f"did not finish its answer in {gw.timeout_s:g} s"
        )
    except (aiohttp.ClientError, ValueError) as exc:  # cut, or not an answer (orjson's error is a ValueError)
        log.error(
            "the upstream's answer is unreadable",
            extra={"request_id": request_id, "error": f"{type(exc).__name__}: {exc}"},
        )
        return _upstream_failed(
            gw, endpoint, 502, "upstream_error", f"gave an unreadable answer ({type(exc).__name__})"
        )
    gw.requests.labels(endpoint, "ok").inc()
    order = record.add_whole(data, chat)
    await keep_all(gw, record, served, request_body, sent, headers)
    for index, choice in zip(order, [c for c in data.get("choices") or () if isinstance(c, dict)]):
        if len(record.choices) > 1:
            choice["request_id"] = record.id_of(index)  # as rtrl serve names them
        if not asked_token_ids:
            choice.pop("token_ids", None)
        if not asked_logprobs:
            choice.pop("logprobs", None)
        elif chat:
            choice["logprobs"] = {
                **(choice.get("logprobs") or {}),
                "content": _as_asked(record.choices[index].entries, asked_ids),
            }
    data["id"] = request_id
    return Response(orjson.dumps(data), media_type="application/json", headers=out_headers)


async def relay(
    gw: Gateway,
    answer: aiohttp.ClientResponse,
    record: AnswerRecord,
    version: str,
    body: dict[str, Any],
    sent: dict[str, Any],
    headers: Any,
    chat: bool,
    asked_logprobs: bool,
    asked_ids: bool,
) -> AsyncIterator[bytes]:
    """The upstream's chunks to the client, as asked; the events once the stream ends (a client
    that leaves cancels this generator: the upstream's connection is closed, which stops its
    generation, and the events are marked truncated). An upstream that fails mid-stream --
    an error frame, a cut connection, a chunk that is not JSON -- gives the client an error
    frame, and the events say so."""
    kept, endpoint = False, "chat" if chat else "completions"
    asked_token_ids = bool(body.get("return_token_ids"))
    try:
        try:
            ended = False
            async for line in answer.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[len(b"data: ") :].strip()
                if payload == b"[DONE]":
                    ended = True
                    break
                chunk = orjson.loads(payload)
                record.add_chunk(chunk, chat)
                if record.error is not None:  # vLLM: an error frame, then [DONE]
                    yield b"data: " + orjson.dumps({"error": record.error}) + b"\n\n"
                    continue
                chunk["id"] = record.request_id
                for choice in chunk.get("choices", []):
                    if choice_index(choice) > 0 or len(record.choices) > 1:
                        choice["request_id"] = record.id_of(choice_index(choice))
                    lp = choice.get("logprobs") or {}
                    if not asked_token_ids:
                        choice.pop("token_ids", None)
                    if not asked_logprobs:
                        choice.pop("logprobs", None)
                    elif chat and lp.get("content"):
                        choice["logprobs"] = {"content": _as_asked(lp["content"], asked_ids)}
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
            if not ended and record.error is None:
                record.error = {"message": f"the upstream {gw.upstream} ended the stream without [DONE]"}
                yield _error_frame(record.error["message"], "upstream_error", 502)
        except Exception as exc:  # noqa: BLE001 - cut, timed out, a line too long, a chunk not an answer
            record.error = {"message": f"the upstream {gw.upstream} failed mid-stream: {type(exc).__name__}"}
            log.error(
                "the upstream failed mid-stream",
                extra={"request_id": record.request_id, "error": f"{type(exc).__name__}: {exc}"},
            )
            yield _error_frame(record.error["message"], "upstream_error", 502)
        kept = True  # the events (marked when the upstream failed) before the client hears the end
        await keep_all(gw, record, version, body, sent, headers)
        yield b"data: [DONE]\n\n"
    finally:
        answer.close()
        gw.requests.labels(
            endpoint, "upstream_error" if record.error is not None else "ok" if kept else "disconnected"
        ).inc()
        if not kept and any(r.completion or r.entries or r.calls for r in record.choices.values()):
            await keep_all(gw, record, version, body, sent, headers, truncated=True)  # the client left first
