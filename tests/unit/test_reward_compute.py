"""The reward of one episode: properties (hypothesis), the two production reward hacks as
regression tests, and the spec's refusal of malformed files."""

from __future__ import annotations

import random
from datetime import datetime, timedelta

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reward.compute import compute_reward, is_ripe
from reward.signals import SIGNALS, Episode, Feedback, decayed, numeric
from reward.spec import RewardSpec, SpecError, load_spec, parse_spec

SPEC = load_spec()
_dumped = SPEC.model_dump()
# the default spec with every signal decaying (half-life 15 minutes): the properties hold for it too
DECAYING = RewardSpec.model_validate(
    {
        **_dumped,
        "name": "decaying",
        "signals": {kind: {**sig, "half_life_s": 900} for kind, sig in _dumped["signals"].items()},
    }
)
T0 = datetime(2026, 11, 1, 12, 0)
KINDS = ["accepted", "rejected", "edited", "persisted", "followup", "thumbs", "tool_error", "test_result", "csat"]


def fb(kind: str, value: float = 1.0, seconds: int = 10, payload=None, event_id: str | None = None) -> Feedback:
    return Feedback(
        event_id=event_id or f"{kind}-{seconds}-{value}",
        kind=kind,
        value=float(value),
        ts=T0 + timedelta(seconds=seconds),
        payload=payload,
    )


def episode(text: str = "def add(a, b):\n    return a + b", feedback=(), tool_calls=()) -> Episode:
    return Episode(
        request_id="r", ts=T0, policy_version="1", text=text, tool_calls=tuple(tool_calls), feedback=tuple(feedback)
    )


feedback_events = st.builds(
    fb,
    kind=st.sampled_from(KINDS),
    value=st.one_of(st.booleans().map(float), st.floats(-3, 3)),
    seconds=st.integers(0, 7200),
    payload=st.one_of(st.none(), st.text(max_size=40).map(lambda t: {"text": t})),
)
texts = st.text(max_size=300)


@settings(max_examples=300, deadline=None)
@given(text=texts, events=st.lists(feedback_events, max_size=8))
# found by CI: two events tied on time and id, differing in payload, used to be order-dependent
@example(text="0", events=[fb("edited", 1.0, 0), fb("accepted", 0.0, 0), fb("edited", 1.0, 0, {"text": ""})])
def test_reward_is_deterministic_within_bounds_and_order_free(text, events):
    ep = episode(text, events)
    first = compute_reward(ep, SPEC)
    assert compute_reward(ep, SPEC) == first
    assert SPEC.clip.min <= first.value <= SPEC.clip.max
    shuffled = list(events)
    random.Random(len(events)).shuffle(shuffled)
    assert compute_reward(episode(text, shuffled), SPEC) == first


POSITIVE = [
    fb("accepted", 1, 50, event_id="p1"),
    fb("persisted", 1, 60, event_id="p2"),
    fb("thumbs", 1, 70, event_id="p3"),
    fb("test_result", 1, 80, event_id="p4"),
]


@settings(max_examples=300, deadline=None)
@given(
    text=texts,
    events=st.lists(feedback_events, max_size=6),
    extra=st.sampled_from(POSITIVE),
    spec=st.sampled_from([SPEC, DECAYING]),
)
def test_adding_a_positive_signal_never_lowers_the_reward(text, events, extra, spec):
    events = [e for e in events if e.kind != extra.kind]  # a kind the episode has not seen yet
    before = compute_reward(episode(text, events), spec).value
    after = compute_reward(episode(text, events + [extra]), spec).value
    assert after >= before


@settings(max_examples=300, deadline=None)
@given(event=feedback_events, half_life_s=st.floats(1, 86400), before_s=st.integers(0, 600))
def test_decay_keeps_a_signals_sign_and_never_grows_it(event, half_life_s, before_s):
    fn = SIGNALS.get(event.kind, numeric)
    ep = episode(feedback=[event])._replace(ts=T0 - timedelta(seconds=before_s))
    plain, decayed_value = fn(event, ep), decayed(fn, half_life_s)(event, ep)
    assert abs(decayed_value) <= abs(plain)
    assert decayed_value * plain >= 0  # same sign (or zero)


def test_decay_halves_a_signal_at_each_half_life():
    spec = parse_spec('name = "x"\n[signals.followup]\nweight = 0.3\nhalf_life_s = 600\n')

    def followup_at(seconds):
        return compute_reward(episode(feedback=[fb("followup", 1, seconds)]), spec).components["signal.followup"]

    assert followup_at(0) == pytest.approx(-0.3)
    assert followup_at(600) == pytest.approx(-0.15)
    assert followup_at(1200) == pytest.approx(-0.075)
    assert followup_at(-30) == pytest.approx(-0.3)  # an event stamped before the interaction: no decay
    # a kind without a half-life is not decayed, however late
    late = compute_reward(episode(feedback=[fb("accepted", 1, 7200)]), SPEC).components["signal.accepted"]
    assert late == pytest.approx(0.5)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(feedback_events, max_size=6), age_s=st.integers(0, 3 * 3600))
def test_ripeness_is_the_window_or_a_terminal_signal(events, age_s):
    ep = episode(feedback=events)
    ripe = is_ripe(ep, SPEC, T0 + timedelta(seconds=age_s))
    terminal = any(e.kind in SPEC.ripeness.terminal_kinds for e in events)
    assert ripe == (age_s >= SPEC.ripeness.window_s or terminal)


# --- the two reward hacks reported from production RL, as regression tests -------------------


def test_a_broken_tool_call_costs_more_than_an_honest_failed_attempt():
    honest = episode(
        "I ran the tests; they fail on the edge case.",
        [fb("test_result", 0)],
        tool_calls=[{"name": "run_tests", "arguments": "{}"}],
    )
    broken = episode(
        "I ran the tests; they fail on the edge case.",
        [fb("test_result", 0), fb("tool_error", 1)],
        tool_calls=[{"name": "run_tests", "arguments": "{not json"}],
    )
    no_name = episode("I ran the tests.", [fb("test_result", 0)], tool_calls=[{"arguments": "{}"}])
    r_honest = compute_reward(honest, SPEC).value
    assert compute_reward(broken, SPEC).value < r_honest
    assert compute_reward(no_name, SPEC).value < r_honest
    assert compute_reward(broken, SPEC).components["guard.tool_format"] < 0


@pytest.mark.parametrize(
    "abstain", ["", "   ", "Sorry, I can't help with that.", "Could you clarify what you mean by 'fast'?"]
)
def test_abstaining_never_beats_an_accepted_attempt_nor_the_average_attempt(abstain):
    # In production an abstention draws no negative signal: no feedback at all, or even thumbs-up.
    silent = compute_reward(episode(abstain), SPEC).value
    praised = compute_reward(episode(abstain, [fb("accepted"), fb("thumbs")]), SPEC).value
    accepted = compute_reward(episode(feedback=[fb("accepted")]), SPEC).value
    assert max(silent, praised) < accepted
    # the average attempt: a realistic mix of outcomes of honest attempts
    rng = random.Random(7)
    outcomes = [
        [fb("accepted"), fb("persisted")],
        [fb("accepted"), fb("persisted", 0, 900)],
        [fb("rejected")],
        [fb("edited", payload={"text": "def add(a, b):\n    return b + a"})],
        [fb("followup")],
        [],
    ]
    attempts = [compute_reward(episode(feedback=rng.choice(outcomes)), SPEC).value for _ in range(500)]
    assert silent < sum(attempts) / len(attempts)


def test_edit_is_scaled_by_similarity():
    same = compute_reward(episode(feedback=[fb("edited", payload={"text": "def add(a, b):\n    return a + b"})]), SPEC)
    rewritten = compute_reward(episode(feedback=[fb("edited", payload={"text": "SELECT * FROM users;"})]), SPEC)
    assert same.components["signal.edited"] == pytest.approx(SPEC.signals["edited"].weight)
    assert rewritten.components["signal.edited"] < 0


def test_contradictory_feedback_accepted_then_reverted():
    ep = episode(feedback=[fb("accepted", 1, 5), fb("persisted", 0, 600)])
    result = compute_reward(ep, SPEC)
    assert result.components == {"signal.accepted": 0.5, "signal.persisted": -0.4}
    assert result.value == pytest.approx(0.1)


# --- malformed specs are refused with file, field and what is allowed -------------------------


@pytest.mark.parametrize(
    "body, field, allowed",
    [
        (
            'name = "x"\n[signals.accepted]\nweight = 0.5\nwieght = 1',
            "signals.accepted.wieght",
            "Extra inputs are not permitted",
        ),
        ('name = "x"\n[signals.accepted]\nweight = "high"', "signals.accepted.weight", "valid number"),
        ('name = "x"\n[signals.accepted]\nweight = 50', "signals.accepted.weight", "less than or equal to 10"),
        (
            'name = "x"\n[signals.accepted]\nweight = 0.5\ncombine = "avg"',
            "signals.accepted.combine",
            "'last', 'sum', 'max', 'min' or 'mean'",
        ),
        ('name = "x"\n[signals.accepted]\nweight = 0.5\n[clip]\nmin = 0.5', "clip.min", "less than or equal to 0"),
        (
            'name = "x"\n[signals.a]\nweight = 1\n[guards.abstention]\npatterns = ["(unclosed"]',
            "guards.abstention.patterns",
            "not a regular expression",
        ),
        (
            'name = "x"\n[signals.followup]\nweight = 0.3\nhalf_life_s = 0',
            "signals.followup.half_life_s",
            "greater than 0",
        ),
    ],
)
def test_malformed_spec_is_refused_with_file_field_and_allowed(tmp_path, body, field, allowed):
    path = tmp_path / "new.toml"
    path.write_text(body)
    with pytest.raises(SpecError) as err:
        load_spec(path)
    message = str(err.value)
    assert str(path) in message and field in message and allowed in message, message


def test_spec_version_is_name_and_content_hash():
    a = parse_spec('name = "x"\n[signals.accepted]\nweight = 0.5\n')
    b = parse_spec('# same content, other formatting\nname="x"\n\n[signals.accepted]\nweight=0.50\n')
    c = parse_spec('name = "x"\n[signals.accepted]\nweight = 0.6\n')
    assert a.version == b.version != c.version and a.version.startswith("x@")


def test_a_half_life_makes_a_new_version_and_specs_without_one_keep_theirs():
    plain = parse_spec('name = "x"\n[signals.accepted]\nweight = 0.5\n')
    decaying = parse_spec('name = "x"\n[signals.accepted]\nweight = 0.5\nhalf_life_s = 600\n')
    assert plain.version != decaying.version
    # Every stored reward carries its spec's version. This is the default spec's version from
    # before half-lives existed: a change to how versions are hashed must not re-version the
    # rewards users already have (change it only with reward/default_spec.toml itself).
    assert SPEC.version == "default@becf22453442"
