"""A request's body as the gateway reads it: bounded in size and in time, a JSON object or the
error to answer. No limit let one client fill the memory with a body, or hold a connection open
by trickling one; reading it with a deadline keeps such a client on its own connection."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse


def _refused(message: str, status: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, status)


async def json_object(request: Request, max_bytes: int, timeout_s: float) -> dict[str, Any] | JSONResponse:
    """The request's body as a JSON object, or the error to answer: over `max_bytes` (413, from
    its Content-Length or as it arrives), not arrived within `timeout_s` (408), not a JSON
    object (400)."""
    declared = request.headers.get("content-length") or ""
    if declared.isdigit() and int(declared) > max_bytes:
        return _refused(f"the request body is over {max_bytes} bytes", 413)
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    return _refused(f"the request body is over {max_bytes} bytes", 413)
                chunks.append(chunk)
    except TimeoutError:
        return _refused(f"the request body did not arrive within {timeout_s:g} s", 408)
    try:
        body = orjson.loads(b"".join(chunks))
    except orjson.JSONDecodeError:
        body = None
    if not isinstance(body, dict):
        return _refused("the request body must be a JSON object", 400)
    return body
