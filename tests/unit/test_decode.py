"""The decoder: every bad-input class has its reason, good events keep unknown fields, and no
input whatsoever gets an exception out of it (hypothesis fuzz)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ingest.decode import decode
from pipeline.core.decoded import DecodedFeedback, DecodedInteraction
from pipeline.core.types import DeadLetter, SourcePosition
from tests.support.decode_cases import BAD, EXPECTED, MAX
from tests.support.factories import encode, feedback, interaction

POS = SourcePosition(source="t", partition=2, offset=41)


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
