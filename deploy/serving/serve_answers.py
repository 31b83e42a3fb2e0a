"""How rtrl serve writes an answer out (deploy/serving/serve_api.py's routes): whole, as one JSON
body in OpenAI's shape, or streamed, as server-sent events in OpenAI's chunk format.

Every answer carries the per-token log-probs of what was sampled and its token ids (`token_id`, an
rtrl extension), `usage`, and the version that produced it (header X-Rtrl-Policy-Version).

A stream: generation in a thread, its tokens through a queue to the client, each as it is
sampled, then `[DONE]`. Tool-call text is held back until it parses (then sent as tool-call
deltas) or does not (then sent as content). The interaction event is kept before the client hears
the end; a client that goes away stops the generation at its next token, and the event is marked
`truncated` (training skips it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from deploy.serving.serve import Answer, PolicyServer, header_id, new_request_id
from deploy.serving.serve_requests import ChatRequest, CompletionRequest, SamplingRequest
from pipeline.core.chat import held_back

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


def usage(server: PolicyServer, prompt: Any, tools: Any, answers: list[Answer]) -> dict[str, int]:
    prompt_tokens = server.runner.prompt_tokens(prompt, tools) or 0
    completion = sum(len(a.gen.token_ids) for a in answers)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _headers(answers: list[Answer]) -> dict[str, str]:
    return {"X-Rtrl-Policy-Version": answers[0].version, "X-Request-Id": answers[0].request_id}


def _message(a: Answer) -> tuple[dict[str, Any], str]:
    if a.calls is not None and a.calls.valid:
        return {"role": "assistant", "content": a.calls.content, "tool_calls": a.calls.calls}, "tool_calls"
    return {"role": "assistant", "content": a.gen.text}, a.finish


def token_name(tok: Any, t: int, as_ids: bool) -> str:
    return f"token_id:{t}" if as_ids else tok.decode([t])


def token_entry(tok: Any, t: int, lp: float, as_ids: bool) -> dict[str, Any]:
    """A chat log-prob entry, as vLLM writes one ("token_id:<id>" when the client asked for ids)."""
    return {"token": token_name(tok, t, as_ids), "logprob": lp, "token_id": t, "bytes": list(tok.decode([t]).encode())}


def completion_answer(server: PolicyServer, req: CompletionRequest, answers: list[Answer]) -> JSONResponse:
    tok, as_ids = server.runner.tokenizer, req.return_tokens_as_token_ids
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
                    "tokens": [token_name(tok, t, as_ids) for t in a.gen.token_ids],
                    "token_logprobs": a.gen.logprobs,
                    "token_ids": a.gen.token_ids,
                },
                "token_ids": a.gen.token_ids if req.return_token_ids else None,
            }
            for i, a in enumerate(answers)
        ],
        "usage": usage(server, req.prompt, None, answers),
    }
    return JSONResponse(body, headers=_headers(answers))


def chat_answer(server: PolicyServer, req: ChatRequest, messages: list[Any], answers: list[Answer]) -> JSONResponse:
    tok, as_ids = server.runner.tokenizer, req.return_tokens_as_token_ids
    choices = []
    for i, a in enumerate(answers):
        msg, finish = _message(a)
        content = [token_entry(tok, t, lp, as_ids) for t, lp in zip(a.gen.token_ids, a.gen.logprobs)]
        choices.append(
            {
                "index": i,
                "request_id": a.request_id,
                "message": msg,
                "finish_reason": finish,
                "logprobs": {"content": content},
                "token_ids": a.gen.token_ids if req.return_token_ids else None,
            }
        )
    body = {
        "id": answers[0].request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": f"{server.model_name}:{answers[0].version}",
        "choices": choices,
        "usage": usage(server, messages, req.tools, answers),
    }
    return JSONResponse(body, headers=_headers(answers))


def streamed_answer(
    server: PolicyServer,
    req: SamplingRequest,
    prompt: Any,
    tools: Any,
    parse: Any,
    request_headers: dict[str, str],
    chat: bool,
) -> StreamingResponse:
    """Generation in a thread, its tokens through a queue to the client as server-sent events;
    the event once the stream ends (truncated if the client went away first)."""
    tok = server.runner.tokenizer
    tokens: queue.Queue = queue.Queue()
    stop, result = threading.Event(), {"id": new_request_id()}
    # chosen now, so that the response's headers can say which version answers
    version = server.choose(req.model, request_headers, header_id(request_headers, "x-rtrl-episode-id") or result["id"])

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
        }
        return f"data: {json.dumps({**body, **extra})}\n\n"

    async def events() -> AsyncIterator[str]:
        finished, kept, ids, text, sent = False, False, [], "", 0
        try:
            if chat:
                yield chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            while (item := await asyncio.to_thread(tokens.get)) is not None:
                token, lp = item
                ids.append(token)
                text = tok.decode([t for t in ids if t != tok.eos_token_id])
                # tool-call text is held back until the answer is whole: it parses or it does not
                safe = held_back(text) if parse else len(text)
                piece, sent = text[sent : max(safe, sent)], max(safe, sent)
                entry = {
                    "token": token_name(tok, token, req.return_tokens_as_token_ids),
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
            yield chunk(last, **({"usage": usage(server, prompt, tools, [a])} if include_usage else {}))
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
