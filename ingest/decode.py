"""Bytes -> event or dead letter. Pure, total: `decode` never raises.

The checks run cheapest first, and each failure class has its own dead-letter reason:

    size > max_event_bytes          -> oversized
    not UTF-8                       -> invalid_utf8
    not JSON / NaN / not an object  -> malformed_json
    schema_version > supported      -> unsupported_schema_version   (checked before the shape:
                                                                      a newer event may differ)
    fails the v1 contract           -> schema_violation

Two decoders, one verdict:

- `decode_reference` is the contract's own check, in the order above: orjson (strict RFC 8259:
  unlike json.loads it refuses the NaN/Infinity literals -- the store's PostgreSQL `json`
  cannot hold them --, unpaired surrogate escapes -- they cannot be stored as UTF-8 text -- and
  nesting deeper than 1024, all as malformed_json; UTF-16/32 bytes are refused by the explicit
  UTF-8 step before it), then the pydantic models of pipeline/core/types.py.
- `decode` first parses the bytes with orjson (is it JSON?) and then decodes them with msgspec
  straight into the structs of pipeline/core/decoded.py, which are never looser than the
  reference (together ~20 us instead of ~27 us for a 2 KB event on this machine's core). A
  record they refuse -- every bad record, and the rare good one that needs one of pydantic's
  lax coercions -- goes to the reference, whose verdict and wording stand.
  tests/unit/test_decode_differential.py holds the two to the same verdicts.
"""

from __future__ import annotations

import orjson
from pydantic import TypeAdapter, ValidationError

from pipeline.core.decoded import FAST_DECODER, DecodedEvent, from_reference
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


def decode(raw: bytes | None, position: SourcePosition, max_event_bytes: int) -> DecodedEvent | DeadLetter:
    """Decode one record's value into an event, or explain why not as a dead letter."""
    raw = b"" if raw is None else bytes(raw)
    if len(raw) <= max_event_bytes and (event := decode_fast(raw)) is not None:
        return event
    result = decode_reference(raw, position, max_event_bytes)
    if isinstance(result, DeadLetter):
        return result
    try:
        return from_reference(result)
    except Exception as exc:  # noqa: BLE001 - the decoder is total; the differential test keeps this unreached
        return DeadLetter(
            reason=DeadLetterReason.SCHEMA_VIOLATION,
            detail=f"unexpected decoder error: {exc}"[:500],
            raw=raw,
            source=position.source,
            partition=position.partition,
            offset=position.offset,
        )


def decode_fast(raw: bytes) -> DecodedEvent | None:
    """The fast path alone: the event, or None where it refuses the record (the reference decides)."""
    try:
        # orjson first: whether the bytes are JSON stays its verdict (pipeline/core/decoded.py)
        orjson.loads(raw)
        return FAST_DECODER.decode(raw)
    except Exception:  # noqa: BLE001 - refused, or input the structs do not foresee
        return None


def decode_reference(
    raw: bytes | None, position: SourcePosition, max_event_bytes: int
) -> InteractionEvent | FeedbackEvent | DeadLetter:
    """The contract's own check (pydantic): what `decode` answers for every record its fast
    path refuses, and what the differential test compares that path with."""
    raw = b"" if raw is None else bytes(raw)

    def dead(reason: DeadLetterReason, detail: str) -> DeadLetter:
        return DeadLetter(
            reason=reason,
            detail=detail,
            raw=raw,
            source=position.source,
            partition=position.partition,
            offset=position.offset,
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
