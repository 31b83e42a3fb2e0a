"""The decoder: every bad-input class has its reason, good events keep unknown fields, and no
input whatsoever gets an exception out of it (hypothesis fuzz)."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.decode import decode
from pipeline.core.decoded import DecodedFeedback, DecodedInteraction
from pipeline.core.types import DeadLetter, SourcePosition
from tests.factories import encode, feedback, interaction

POS = SourcePosition(source="t", partition=2, offset=41)
MAX = 64 * 1024


def test_valid_interaction_with_unknown_fields_decodes_and_normalises_time():
    ev = interaction(1, ts="2026-11-01T13:00:00+01:00", shiny_new_field={"a": 1})
    out = decode(encode(ev), POS, MAX)
    assert isinstance(out, DecodedInteraction)  # the field itself is kept in the stored body
    assert out.ts.isoformat() == "2026-11-01T12:00:00+00:00"


def test_agent_trajectory_completion_is_accepted():
    traj = [
        {"role": "assistant", "content": "", "tool_calls": [{"name": "ls", "arguments": "{}"}]},
        {"role": "tool", "content": "a.py"},
        {"role": "assistant", "content": "done"},
    ]
    assert isinstance(decode(encode(interaction(2, completion=traj)), POS, MAX), DecodedInteraction)


@pytest.mark.parametrize("value", [True, 0, 0.25, -3])
def test_feedback_values(value):
    out = decode(encode(feedback(1, kind="some_new_kind", value=value)), POS, MAX)
    assert isinstance(out, DecodedFeedback) and out.value == value and out.kind == "some_new_kind"


BAD = {
    "invalid_utf8": b'{"schema_version": 1, "x": "\xff\xfe"}',
    "utf16_is_not_utf8": '{"schema_version": 1}'.encode("utf-16"),
    "malformed_json": b'{"schema_version": 1,',
    "nan_literal": b'{"schema_version": 1, "value": NaN}',
    "not_an_object": b"[1, 2, 3]",
    "empty": b"",
    "deep_nesting": b"[" * 30_000 + b"]" * 30_000,
    "newer_schema": encode(interaction(1, schema_version=2)),
    "missing_field": encode({k: v for k, v in interaction(1).items() if k != "completion"}),
    "wrong_type": encode(interaction(1, latency_ms="fast")),
    "unknown_type": encode(dict(interaction(1), type="purchase")),
    "naive_ts": encode(interaction(1, ts="2026-11-01T12:00:00")),
    "nul_in_id": encode(interaction(1, request_id="r\x00")),
    "lone_surrogate": b'{"schema_version":1,"event_id":"e","type":"feedback","ts":"2026-11-01T00:00:00Z",'
    b'"request_id":"r","kind":"thumbs","value":1,"payload":"\\ud800"}',
    "bool_schema_version": encode(interaction(1, schema_version=True)),
    "oversized": encode(interaction(1, size=MAX + 10)),
    "gzip_bytes": gzip.compress(encode(interaction(1))),
    # what later stages trust: the behaviour log-probs' sampling settings must be numbers
    "temperature_not_a_number": encode(interaction(1, sampling={"temperature": "auto"})),
    "top_p_a_list": encode(interaction(1, sampling={"temperature": 0.7, "top_p": [0.9]})),
    "negative_temperature": encode(interaction(1, sampling={"temperature": -1})),
    "feedback_value_at_float_max": encode(feedback(1, value=1.7976931348623157e308)),
}
EXPECTED = {
    "invalid_utf8": "invalid_utf8",
    "utf16_is_not_utf8": "invalid_utf8",
    "malformed_json": "malformed_json",
    "nan_literal": "malformed_json",
    "not_an_object": "malformed_json",
    "empty": "malformed_json",
    "deep_nesting": "malformed_json",
    "newer_schema": "unsupported_schema_version",
    "missing_field": "schema_violation",
    "wrong_type": "schema_violation",
    "unknown_type": "schema_violation",
    "naive_ts": "schema_violation",
    "nul_in_id": "schema_violation",
    "lone_surrogate": "malformed_json",
    "bool_schema_version": "schema_violation",
    "oversized": "oversized",
    "gzip_bytes": "invalid_utf8",
    "temperature_not_a_number": "schema_violation",
    "top_p_a_list": "schema_violation",
    "negative_temperature": "schema_violation",
    "feedback_value_at_float_max": "schema_violation",
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_each_bad_input_class_is_a_dead_letter_with_its_reason(case):
    out = decode(BAD[case], POS, MAX)
    assert isinstance(out, DeadLetter), out
    assert out.reason.value == EXPECTED[case], out.detail
    assert out.raw == BAD[case]
    assert (out.source, out.partition, out.offset) == ("t", 2, 41)
    assert out.detail


def test_none_value_is_a_dead_letter():
    out = decode(None, POS, MAX)
    assert isinstance(out, DeadLetter) and out.raw == b""


@settings(max_examples=600, deadline=None)
@given(st.binary(max_size=4096))
def test_fuzz_arbitrary_bytes_never_raise(raw):
    out = decode(raw, POS, 2048)
    assert isinstance(out, (DeadLetter, DecodedInteraction, DecodedFeedback))


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


@settings(max_examples=400, deadline=None)
@given(base=st.sampled_from([interaction(3), feedback(3)]), key=st.sampled_from(sorted(interaction(3))), junk=_json)
def test_fuzz_mutated_events_never_raise(base, key, junk):
    mutated = dict(base)
    mutated[key] = junk
    out = decode(json.dumps(mutated).encode(), POS, MAX)
    assert isinstance(out, (DeadLetter, DecodedInteraction, DecodedFeedback))
    if isinstance(out, DeadLetter):
        assert out.reason.value in {"schema_violation", "unsupported_schema_version"}


def test_a_model_update_round_trips_and_a_malformed_one_is_refused():
    from pipeline.core.types import ModelUpdate

    update = ModelUpdate(
        "canary",
        "7",
        "runs:/abc/adapter",
        share=0.25,
        name="m",
        seq=12,
        base_model="/models/q",
        run_id="abc",
        at="2026-01-01T00:00:00Z",
    )
    assert ModelUpdate.from_json(json.dumps(update.to_dict())) == update
    cleared = ModelUpdate.from_json('{"type": "model_update", "name": "m", "alias": "champion", "version": null}')
    assert cleared.version is None and cleared.share == 0.0 and cleared.seq is None
    for raw in (
        "[1]",
        '{"type": "interaction", "alias": "champion"}',
        '{"alias": 3}',
        '{"alias": "canary", "version": 7}',
        '{"alias": "canary", "version": "7", "share": "half"}',
        "nope",
    ):
        with pytest.raises(ValueError):
            ModelUpdate.from_json(raw)
