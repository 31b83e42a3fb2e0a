"""Bytes -> event or dead letter. Pure, total: `decode` never raises.

The checks run cheapest first, and each failure class has its own dead-letter reason:

    size > max_event_bytes          -> oversized
    not UTF-8                       -> invalid_utf8
    not JSON / NaN / not an object  -> malformed_json
    schema_version > supported      -> unsupported_schema_version   (checked before the shape:
                                                                      a newer event may differ)
    fails the v1 contract           -> schema_violation

The parser is orjson (strict RFC 8259): unlike json.loads it refuses the NaN/Infinity literals
(the store's PostgreSQL `json` cannot hold them), unpaired surrogate escapes (they cannot be
stored as UTF-8 text) and nesting deeper than 1024, all as malformed_json; UTF-16/32 bytes are
refused by the explicit UTF-8 step before it.
"""

from __future__ import annotations

import orjson
from pydantic import TypeAdapter, ValidationError

from pipeline.core.types import (
    SCHEMA_VERSION,
    DeadLetter,
    DeadLetterReason,
    Event,
    FeedbackEvent,
    InteractionEvent,
    SourcePosition,
)

_EVENT = TypeAdapter(Event)


def _describe(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        loc = ".".join(str(p) for p in err["loc"]) or "<event>"
        parts.append(f"{loc}: {err['msg']}")
    more = exc.error_count() - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def decode(
    raw: bytes | None, position: SourcePosition, max_event_bytes: int
) -> InteractionEvent | FeedbackEvent | DeadLetter:
    """Decode one record's value into an event, or explain why not as a dead letter."""
    raw = b"" if raw is None else bytes(raw)

    def dead(reason: DeadLetterReason, detail: str) -> DeadLetter:
        return DeadLetter(
            reason=reason, detail=detail, raw=raw,
            source=position.source, partition=position.partition, offset=position.offset,
        )

    try:
        if len(raw) > max_event_bytes:
            return dead(DeadLetterReason.OVERSIZED, f"{len(raw)} bytes > max_event_bytes={max_event_bytes}")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return dead(DeadLetterReason.INVALID_UTF8, f"not UTF-8: {exc.reason} at byte {exc.start}")
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            return dead(DeadLetterReason.MALFORMED_JSON, f"not JSON: {exc}"[:500])
        if not isinstance(obj, dict):
            return dead(DeadLetterReason.MALFORMED_JSON, f"expected a JSON object, got {type(obj).__name__}")
        version = obj.get("schema_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > SCHEMA_VERSION:
            return dead(
                DeadLetterReason.UNSUPPORTED_SCHEMA_VERSION,
                f"schema_version {version} is newer than supported ({SCHEMA_VERSION}): upgrade rtrl, "
                "then `rtrl replay --dead-letters`",
            )
        try:
            event = _EVENT.validate_python(obj)
        except ValidationError as exc:
            return dead(DeadLetterReason.SCHEMA_VIOLATION, _describe(exc))
        return event
    except Exception as exc:  # noqa: BLE001 - the decoder is total by contract; never crash ingest
        return dead(DeadLetterReason.SCHEMA_VIOLATION, f"unexpected decoder error: {type(exc).__name__}: {exc}"[:500])
