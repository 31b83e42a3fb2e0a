"""An event as ingest decoded it: the contract v1 (types.py) checked in compiled code.

`InteractionEvent` / `FeedbackEvent` in types.py are the contract: producers build them, and
their pydantic validation is the reference for what a valid event is. Ingest checks every
record against the same contract: at ~2 KB an event, orjson + pydantic cost ~27 us on one of
this machine's cores. msgspec decodes the JSON bytes straight into these structs and validates
them in one pass in C; with orjson's parse before it and the checks in `__post_init__`, ~20 us
(docs/benchmarks.md, "Ingest").

The structs mirror the models field for field and are *stricter or equal* everywhere, never
looser: ingest's decoder (ingest/decode.py) tries them first and, for a record they refuse,
asks the reference, whose verdict and wording are the dead letter's. So a record the reference
accepts with a lax coercion (`"latency_ms": "41.5"`, `"truncated": 1`, a Unix timestamp as
`ts`) is still an event, and the differential test (tests/unit/test_decode_differential.py) checks
the other direction: whatever these accept, the reference accepts, with the same values.
Where msgspec alone would be looser than orjson + pydantic, the structs say so and close it:

- integers beyond 64 bits: orjson reads them as floats (which a strict int refuses), msgspec
  as Python ints -- every integer field is bounded to int64 (a uint64 beyond it goes to the
  reference);
- timestamps: msgspec rounds a fraction beyond microseconds, pydantic truncates it -- `ts` is
  read as a string and parsed by the reference's own parser (speedate, ~1 us);
- JSON itself: msgspec reads an integer literal of 309 digits or more in an untyped value as a
  Python int, and skips an unknown field's number without reading it (`1e400`); orjson
  refuses both. The decoder therefore lets orjson parse the record first (~6 us): what is
  JSON stays orjson's verdict, and only pydantic's validation is replaced;
- identifiers: NUL and blank values are refused in `__post_init__`, as the reference's
  validator does.

Only ingest uses these; the rest of the code base speaks the pydantic models.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import msgspec
from pydantic import TypeAdapter

from pipeline.core.types import SCHEMA_VERSION, EventTime

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
NonNegative = Annotated[float, msgspec.Meta(ge=0)]

_EVENT_TIME = TypeAdapter(EventTime)  # the reference's parser: RFC 3339 with an offset, to UTC


def _check_ids(*values: str | None) -> None:
    # the reference's Identifier: PostgreSQL text cannot hold NUL; a blank id names nothing (a
    # string whose ends are not whitespace is not blank: strip() only for the rare one that is)
    for value in values:
        if value is not None and (
            "\x00" in value or ((value[0].isspace() or value[-1].isspace()) and not value.strip())
        ):
            raise ValueError("an identifier must not be blank or contain NUL characters")


def _event_time(value: Any) -> datetime:
    if not isinstance(value, str):
        raise ValueError("ts must be an RFC 3339 string")
    try:
        return _EVENT_TIME.validate_python(value)
    except Exception as exc:  # pydantic's ValidationError is no ValueError: msgspec would not catch it
        raise ValueError(f"ts: {exc}") from None


class DecodedSampling(msgspec.Struct, frozen=True):
    temperature: NonNegative | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] | None = None
    top_k: Int64 | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    seed: Int64 | None = None


class DecodedInteraction(msgspec.Struct, tag_field="type", tag="interaction"):
    """types.InteractionEvent as decoded; `ts` a timezone-aware UTC datetime after decoding."""

    schema_version: Annotated[int, msgspec.Meta(ge=1, le=SCHEMA_VERSION)]
    event_id: Id
    ts: Any  # str on the wire, UTC datetime after __post_init__
    request_id: Id
    session_id: Id
    user_id: Id
    tenant: Id
    policy_version: Id
    prompt: str | list[dict[str, Any]]
    completion: str | list[dict[str, Any]]
    completion_token_ids: list[Int64] | None = None
    behavior_logprobs: list[float] | None = None
    sampling: DecodedSampling | None = None
    latency_ms: NonNegative | None = None
    metadata: dict[str, Any] | None = None
    client_request_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    group_id: Id | None = None
    episode_id: Id | None = None
    step: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] | None = None
    truncated: bool | None = None

    type = "interaction"

    def __post_init__(self) -> None:
        self.ts = _event_time(self.ts)
        _check_ids(
            self.event_id,
            self.request_id,
            self.session_id,
            self.user_id,
            self.tenant,
            self.policy_version,
            self.group_id,
            self.episode_id,
        )


class DecodedFeedback(msgspec.Struct, tag_field="type", tag="feedback"):
    """types.FeedbackEvent as decoded."""

    schema_version: Annotated[int, msgspec.Meta(ge=1, le=SCHEMA_VERSION)]
    event_id: Id
    ts: Any
    kind: Id
    value: bool | int | float
    request_id: Id | None = None
    episode_id: Id | None = None
    payload: dict[str, Any] | str | None = None
    tenant: Id | None = None  # whose episode (episode ids are the applications'); None: not named

    type = "feedback"

    def __post_init__(self) -> None:
        self.ts = _event_time(self.ts)
        _check_ids(self.event_id, self.kind, self.request_id, self.episode_id, self.tenant)
        if (self.request_id is None) == (self.episode_id is None):
            raise ValueError("name exactly one of request_id and episode_id")
        if not isinstance(self.value, bool) and abs(self.value) > 1e15:
            raise ValueError("value must be at most 1e15 in magnitude")


DecodedEvent = DecodedInteraction | DecodedFeedback

FAST_DECODER = msgspec.json.Decoder(DecodedEvent)
"""bytes -> DecodedInteraction | DecodedFeedback; raises msgspec.DecodeError / ValidationError
(or anything else on input the structs do not foresee: callers ask the reference then)."""


def from_reference(event: Any) -> DecodedEvent:
    """The reference's event (types.InteractionEvent | FeedbackEvent) as a decoded struct: for a
    record only the reference accepted (a lax coercion, a uint64 beyond int64). Its JSON dump
    holds the coerced values; the structs' constructors run `__post_init__` (the timestamp is
    parsed again, as a string) but not the field constraints, which the reference has checked."""
    data = event.model_dump(mode="json", exclude_none=True)
    if data.pop("type") == "feedback":
        return DecodedFeedback(**data)
    if "sampling" in data:
        data["sampling"] = DecodedSampling(**data["sampling"])
    return DecodedInteraction(**data)
