"""Ingest's fast decoder (msgspec, pipeline/core/decoded.py) against the reference (orjson +
the pydantic contract): on the fuzz corpus, on every bad-input class and on the edges where
the two libraries differ, the verdict -- which event type, or which dead-letter reason -- is
the same, and whatever the fast path accepts on its own the reference accepts too, with the
same row stored."""

from __future__ import annotations

import json

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.decode import decode, decode_fast, decode_reference
from pipeline.core.decoded import FAST_DECODER, from_reference
from pipeline.core.store.events import event_row
from pipeline.core.types import DeadLetter, SourcePosition
from tests.support.decode_cases import BAD
from tests.support.factories import encode, feedback, interaction

POS = SourcePosition(source="t", partition=2, offset=41)
MAX = 64 * 1024


def verdict(result) -> tuple[str, str]:
    return ("dead", result.reason.value) if isinstance(result, DeadLetter) else ("event", result.type)


def comparable(row: dict) -> dict:
    # a tool call's integer beyond 64 bits: exact in the fast path's JSON text, a float in the
    # reference's (orjson reads it as one); read back, both are the same number
    calls = row.get("output_tool_calls")
    return dict(row, output_tool_calls=orjson.loads(calls) if calls else None)


def check(raw: bytes) -> None:
    ref = decode_reference(raw, POS, MAX)
    assert verdict(decode(raw, POS, MAX)) == verdict(ref)
    fast = decode_fast(raw)  # None: refused, and decode asked the reference (compared above)
    if fast is not None and len(raw) <= MAX:
        assert not isinstance(ref, DeadLetter), f"the fast path accepted what the reference refused: {ref.detail}"
        body = raw.decode("utf-8")
        assert comparable(event_row(fast, POS, body)) == comparable(event_row(from_reference(ref), POS, body))


def _with(base: dict, **over) -> bytes:
    return encode(dict(base, **over))


AGENT_CALL = interaction(
    4,
    episode_id="ep-4",
    step=2,
    group_id="g-4",
    client_request_id="c-4",
    truncated=False,
    tools=[{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}],
    tool_calls=[{"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"k": 1}'}}],
    sampling={"temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_tokens": 64, "seed": 3},
)
EPISODE_OUTCOME = feedback(4, request_id=None, episode_id="ep-4", kind="test_result", value=0.5, payload={"passed": 3})
BIG = 123456789012345678901234567890
U64 = 2**64 - 1
EDGES = {
    # pydantic's lax coercions: the fast path refuses them, the reference accepts them
    "latency_as_text": _with(interaction(1), latency_ms="41.5"),
    "truncated_as_int": _with(interaction(1), truncated=1),
    "truncated_as_text": _with(interaction(1), truncated="yes"),
    "ts_as_unix_seconds": _with(interaction(1), ts=1_700_000_000),
    "temperature_as_text": _with(interaction(1), sampling={"temperature": "0.5"}),
    "value_as_text": _with(feedback(1), value="0.5"),
    # integers beyond what orjson reads as an integer: a float there, refused by strict ints
    "big_token_id": _with(interaction(1), completion_token_ids=[1, BIG]),
    "u64_token_id": _with(interaction(1), completion_token_ids=[U64]),
    "big_negative_seed": _with(interaction(1), sampling={"seed": -(2**63) - 1}),
    "big_step": _with(AGENT_CALL, step=BIG),
    "big_value": _with(feedback(1), value=BIG),
    "big_schema_version": _with(interaction(1), schema_version=BIG),
    "big_int_in_metadata": _with(interaction(1), metadata={"n": BIG}),
    "big_int_in_a_tool_call": _with(AGENT_CALL, tool_calls=[{"function": {"name": "lookup", "arguments": BIG}}]),
    "float_schema_version": _with(interaction(1), schema_version=1.0),
    # timestamps: forms and fractions the two parsers might read differently
    "ts_lowercase": _with(interaction(1), ts="2026-11-01t12:00:00z"),
    "ts_space": _with(interaction(1), ts="2026-11-01 12:00:00Z"),
    "ts_nanoseconds": _with(interaction(1), ts="2026-11-01T12:00:00.123456789Z"),
    "ts_comma_fraction": _with(interaction(1), ts="2026-11-01T12:00:00,5Z"),
    "ts_offset_without_colon": _with(interaction(1), ts="2026-11-01T12:00:00+0130"),
    "ts_minus_zero": _with(interaction(1), ts="2026-11-01T12:00:00-00:00"),
    "ts_leap_second": _with(interaction(1), ts="2026-12-31T23:59:60Z"),
    "ts_hour_24": _with(interaction(1), ts="2026-11-01T24:00:00Z"),
    "ts_date_only": _with(interaction(1), ts="2026-11-01"),
    "ts_past_year_9999_in_utc": _with(interaction(1), ts="9999-12-31T23:59:59-01:00"),
    "ts_year_one": _with(interaction(1), ts="0001-01-01T00:00:00+01:00"),
    # identifiers: length in code points, blank, NUL, surrogate pairs
    "id_256_emoji": _with(interaction(1), request_id="\U0001f600" * 256),
    "id_257_emoji": _with(interaction(1), request_id="\U0001f600" * 257),
    "id_blank": _with(interaction(1), tenant="  \t"),
    "id_nul": _with(feedback(1), kind="a\x00"),
    "client_id_257": _with(interaction(1), client_request_id="x" * 257),
    "episode_outcome": encode(EPISODE_OUTCOME),
    "both_subjects": _with(EPISODE_OUTCOME, request_id="r-4"),
    "neither_subject": _with(EPISODE_OUTCOME, episode_id=None),
    "agent_call": encode(AGENT_CALL),
    "top_p_zero": _with(interaction(1), sampling={"top_p": 0}),
    "negative_max_tokens": _with(interaction(1), sampling={"max_tokens": -1}),
    "step_too_large": _with(AGENT_CALL, step=1_000_001),
    "nul_in_output": _with(interaction(1), completion="a\x00b"),
    "payload_a_list": _with(feedback(1), payload=[1]),
    # JSON the two parsers might read differently
    "duplicate_type_last_wins": encode(feedback(1))[:-1] + b', "type": "interaction"}',
    "duplicate_id_bad_then_good": b'{"event_id": 5, ' + encode(feedback(1))[1:],
    "duplicate_id_good_then_bad": encode(feedback(1))[:-1] + b', "event_id": 5}',
    "type_last": encode({k: v for k, v in feedback(1).items() if k != "type"})[:-1] + b', "type": "feedback"}',
    "nesting_1023": _with(interaction(1))[:-1] + b', "x": ' + b"[" * 1022 + b"]" * 1022 + b"}",
    "nesting_1024": _with(interaction(1))[:-1] + b', "x": ' + b"[" * 1023 + b"]" * 1023 + b"}",
    "number_overflow_in_metadata": _with(interaction(1))[:-1] + b', "x": 1e400}',
    "escaped_surrogate_pair": _with(interaction(1))[:-1] + b', "x": "\\ud83d\\ude00"}',
    "lone_low_surrogate": _with(interaction(1))[:-1] + b', "x": "\\udc00"}',
    "big_int_literal_in_metadata": _with(interaction(1))[:-1].replace(b'"region": "eu"', b'"n": 1' + b"0" * 400) + b"}",
    "big_int_literal_unknown_field": _with(interaction(1))[:-1] + b', "x": 1' + b"0" * 400 + b"}",
    "control_char_in_unknown_field": _with(interaction(1))[:-1] + b', "x": "a\x01b"}',
    "invalid_utf8_in_unknown_field": _with(interaction(1))[:-1] + b', "x": "\xff"}',
    "leading_zero_unknown_field": _with(interaction(1))[:-1] + b', "x": 01}',
    "bare_fraction_unknown_field": _with(interaction(1))[:-1] + b', "x": 1.}',
    "plus_sign_unknown_field": _with(interaction(1))[:-1] + b', "x": +1}',
    "bad_escape_unknown_field": _with(interaction(1))[:-1] + b', "x": "\\q"}',
    "bom": b"\xef\xbb\xbf" + encode(feedback(1)),
    "trailing_garbage": encode(feedback(1)) + b" x",
    "trailing_whitespace": encode(feedback(1)) + b" \n",
}


@pytest.mark.parametrize("case", sorted(BAD) + sorted(EDGES))
def test_both_decoders_agree_on_each_bad_input_class_and_edge(case):
    check(BAD[case] if case in BAD else EDGES[case])


def test_the_structs_have_the_contract_s_fields_exactly():
    # a field added to the contract but not to its struct would be an unknown field to the fast
    # path: accepted unchecked -- looser than the reference
    from pipeline.core.decoded import DecodedFeedback, DecodedInteraction, DecodedSampling
    from pipeline.core.types import FeedbackEvent, InteractionEvent, Sampling

    for struct, model in (
        (DecodedInteraction, InteractionEvent),
        (DecodedFeedback, FeedbackEvent),
        (DecodedSampling, Sampling),
    ):
        assert set(struct.__struct_fields__) == set(model.model_fields) - {"type"}, struct


def test_the_fast_path_decides_the_benchmark_s_events_on_its_own():
    # the events ingest sees almost all of: if these went to the reference, nothing was gained
    for raw in (encode(interaction(i, size=2048)) for i in range(20)):
        assert FAST_DECODER.decode(raw).type == "interaction"
    assert FAST_DECODER.decode(encode(AGENT_CALL)).episode_id == "ep-4"
    assert FAST_DECODER.decode(encode(EPISODE_OUTCOME)).value == 0.5


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=2048))
def test_both_decoders_agree_on_arbitrary_bytes(raw):
    check(raw)


_edge_text = st.sampled_from(
    [
        "",
        " ",
        "a\x00",
        "2026-11-01T12:00:00Z",
        "2026-11-01T12:00:00",
        "1e400",
        "NaN",
        "\U0001f600" * 257,
        "yes",
        "0.5",
        "1",
    ]
)
_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | _edge_text,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
_BASES = [interaction(3), feedback(3), AGENT_CALL, EPISODE_OUTCOME]
_KEYS = sorted({k for base in _BASES for k in base} | {"top_k", "temperature"})


@settings(max_examples=800, deadline=None)
@given(base=st.sampled_from(_BASES), key=st.sampled_from(_KEYS), junk=_json, in_sampling=st.booleans())
def test_both_decoders_agree_on_mutated_events(base, key, junk, in_sampling):
    mutated = dict(base)
    if in_sampling and "sampling" in base:
        mutated["sampling"] = dict(base["sampling"], **{key: junk})
    else:
        mutated[key] = junk
    check(json.dumps(mutated).encode())
