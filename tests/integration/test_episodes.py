"""Agent episodes in the contract, the store and the reward stage (SQLite and PostgreSQL): an
outcome that names an episode reaches every call, with equal or discounted credit; per-call
guards stay on their call; an episode ripens when its outcome arrives or its window after the
last call has passed; late outcomes update every call and are counted against a training run;
an episode that never finishes is reported once; any arrival order gives the same rewards."""

from __future__ import annotations

import itertools
import json
from datetime import timedelta

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.cli import cli
from pipeline.core.store.rewards import stored_reward
from pipeline.core.store.training import lineage, record_lineage
from pipeline.core.types import DeadLetterReason
from reward.compute import Scorer
from reward.signals import Episode
from reward.spec import parse_spec
from reward.stage import explain_episode, run_rewards
from tests.support.factories import BASE_TS, interaction
from tests.support.factories import feedback as fb
from tests.support.stores import store

_names = itertools.count()  # one episode name per hypothesis example

LATER = BASE_TS.replace(tzinfo=None) + timedelta(days=1)  # every episode ripe by its window


def _toml_spec(extra: str):
    return parse_spec('name = "ep"\n[signals.persisted]\nweight = 1.0\n[signals.accepted]\nweight = 0.5\n' + extra)


EQUAL = _toml_spec("")
HALVED = _toml_spec('[episode]\ncredit = "discounted"\ngamma = 0.5\n')


def call(episode: str, step: int, i: int, **over) -> dict:
    """Call `step` of an agent episode, served `i` seconds after BASE_TS."""
    return interaction(i, prefix=episode, episode_id=episode, step=step, **over)


def outcome(episode: str, i: int, kind: str = "persisted", value=True, n: int = 0) -> dict:
    ev = fb(i, prefix=episode, kind=kind, value=value, event_id=f"{episode}-outcome-{kind}-{n}", episode_id=episode)
    del ev["request_id"]
    return ev


def rewards(engine, spec, episode: str, steps: int) -> list[float | None]:
    out = []
    for i in range(steps):
        row = stored_reward(engine, f"{episode}-r-{i}", spec.version)
        out.append(None if row is None else round(row.value, 9))
    return out


def test_feedback_names_exactly_one_of_request_and_episode(engine):
    both = dict(outcome("e", 1), request_id="e-r-1", event_id="both")
    neither = {k: v for k, v in outcome("e", 1).items() if k != "episode_id"} | {"event_id": "neither"}
    batch = store(engine, outcome("e", 1), both, neither)
    assert len(batch.rows.feedback) == 1
    letters = [(dl["reason"], dl["detail"]) for dl in batch.rows.dead_letters]
    assert [r for r, _ in letters] == [DeadLetterReason.SCHEMA_VIOLATION.value] * 2
    assert all("exactly one of request_id" in detail for _, detail in letters)


def test_an_episode_outcome_reaches_every_call_with_equal_credit(engine):
    store(
        engine,
        call("ep", 0, 0),
        call("ep", 1, 1),
        call("ep", 2, 2),
        outcome("ep", 3),
        # a call's own feedback stays its own
        fb(1, prefix="ep", kind="accepted"),
    )
    report = run_rewards(engine, EQUAL, now=LATER)
    assert report.computed == 3
    assert rewards(engine, EQUAL, "ep", 3) == [1.0, 1.0, 1.0]  # persisted 1.0, accepted 0.5: clipped at 1
    row = stored_reward(engine, "ep-r-0", EQUAL.version)
    assert row.components == {"episode.signal.persisted": 1.0}
    assert row.outcome == {"episode_id": "ep", "credit": 1.0, "events": ["ep-outcome-persisted-0"]}
    assert stored_reward(engine, "ep-r-1", EQUAL.version).components == {
        "signal.accepted": 0.5,
        "episode.signal.persisted": 1.0,
    }


def test_discounted_credit_halves_per_step_from_the_end_whatever_order_calls_arrive_in(engine):
    # steps as the producer numbered them decide the order, not arrival or timestamps
    store(engine, call("d", 2, 0), call("d", 0, 2), call("d", 1, 1), outcome("d", 5, value=False))
    run_rewards(engine, HALVED, now=LATER)
    assert rewards(engine, HALVED, "d", 3) == [-1.0, -0.5, -0.25]  # d-r-0 is step 2: the last call
    # without steps, the time each call was served orders them
    store(engine, *(interaction(i, prefix="t", episode_id="t") for i in (2, 0, 1)), outcome("t", 5))
    run_rewards(engine, HALVED, now=LATER)
    assert rewards(engine, HALVED, "t", 3) == [0.25, 0.5, 1.0]


def test_a_guard_penalises_the_call_it_concerns(engine):
    broken = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "lookup", "arguments": "{"},
            "error": "arguments are not JSON",
        }
    ]
    store(engine, call("g", 0, 0), call("g", 1, 1, tool_calls=broken), call("g", 2, 2), outcome("g", 3))
    run_rewards(engine, EQUAL, now=LATER)
    values = rewards(engine, EQUAL, "g", 3)
    penalty = EQUAL.guards.tool_format.penalty
    assert values == [1.0, round(1.0 - penalty, 9), 1.0]


def test_an_episode_ripens_with_its_outcome_or_its_window_after_the_last_call(engine):
    spec = _toml_spec("[ripeness]\nwindow_s = 600\n")
    store(engine, call("w", 0, 0), call("w", 1, 500))
    # 700 s after the first call but 200 s after the last: not ripe
    early = run_rewards(engine, spec, now=BASE_TS.replace(tzinfo=None) + timedelta(seconds=700))
    assert (early.computed, early.unripe) == (0, 2)
    # a terminal outcome ripens it at once
    store(engine, outcome("w", 600, kind="persisted"))
    ripe = run_rewards(engine, spec, now=BASE_TS.replace(tzinfo=None) + timedelta(seconds=701))
    assert ripe.computed == 2 and ripe.unfinished_episodes == 0


def test_an_episode_that_never_finishes_is_reported_once_past_its_window(engine):
    store(engine, call("n", 0, 0), call("n", 1, 1), call("m", 0, 2), outcome("m", 3))
    first = run_rewards(engine, EQUAL, now=LATER)
    assert first.computed == 3 and first.unfinished_episodes == 1
    assert "1 agent episodes ended by their window without an outcome" in first.summary()
    assert run_rewards(engine, EQUAL, now=LATER).unfinished_episodes == 0


def test_a_late_outcome_updates_every_call_and_is_counted_against_a_training_run(engine):
    store(engine, call("l", 0, 0), call("l", 1, 1))
    run_rewards(engine, EQUAL, now=LATER)
    assert rewards(engine, EQUAL, "l", 2) == [0.0, 0.0]
    record_lineage(engine, "run-1", EQUAL.version, [("l-r-0", 0.0, None), ("l-r-1", 0.0, None)])
    store(engine, outcome("l", 9, kind="persisted", value=False))
    late = run_rewards(engine, EQUAL, now=LATER)
    assert (late.updated, late.changed_after_training) == (2, 2)
    assert rewards(engine, EQUAL, "l", 2) == [-1.0, -1.0]
    # a later call of the same episode changes nobody's reward under equal credit, but is read
    store(engine, call("l", 2, 2))
    again = run_rewards(engine, EQUAL, now=LATER)
    assert (again.computed, again.updated) == (1, 2) and rewards(engine, EQUAL, "l", 3) == [-1.0] * 3
    assert run_rewards(engine, EQUAL, now=LATER).unchanged >= 3


def test_lineage_records_the_episode_outcome_a_trained_call_used(engine):
    store(engine, call("x", 0, 0), outcome("x", 1))
    run_rewards(engine, EQUAL, now=LATER)
    row = stored_reward(engine, "x-r-0", EQUAL.version)
    record_lineage(engine, "run-x", EQUAL.version, [("x-r-0", row.value, row.outcome)])
    (used,) = lineage(engine, "run-x")
    assert used.outcome == {"episode_id": "x", "credit": 1.0, "events": ["x-outcome-persisted-0"]}


def test_an_orphaned_episode_outcome_is_counted(engine):
    store(engine, outcome("ghost", 0))
    assert run_rewards(engine, EQUAL, now=LATER + timedelta(days=1)).orphaned == 1  # past the orphan TTL


def test_explain_shows_an_episode_its_calls_outcome_and_credit(engine, db_url, tmp_path):
    store(engine, call("e", 0, 0), call("e", 1, 1), outcome("e", 2))
    found = explain_episode(engine, HALVED, "e", now=LATER)
    assert [ep.request_id for ep, _, _ in found] == ["e-r-0", "e-r-1"]
    assert [r.components["episode.signal.persisted"] for _, r, _ in found] == [0.5, 1.0]
    spec = tmp_path / "spec.toml"
    spec.write_text('name = "ep"\n[signals.persisted]\nweight = 1.0\n[episode]\ncredit = "discounted"\ngamma = 0.5\n')
    env = {"RTRL_DB_URL": db_url, "RTRL_STATE_DIR": str(tmp_path)}
    run = CliRunner().invoke(cli, ["reward", "explain", "--episode", "e", "--spec", str(spec)], env=env)
    assert run.exit_code == 0, run.output
    assert "agent episode e: 2 calls" in run.output and "outcome credited +0.5000" in run.output
    as_json = CliRunner().invoke(cli, ["reward", "explain", "e-r-0", "--spec", str(spec), "--json"], env=env)
    assert json.loads(as_json.output)["episode_id"] == "e"


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(order=st.permutations(range(6)), runs_after=st.sets(st.integers(0, 5), max_size=3))
def test_any_arrival_order_gives_every_call_the_same_reward(engine, order, runs_after):
    """Three calls, two outcome events (one terminal) and a call's own feedback, stored in any
    order with reward runs in between: the final rewards are those of scoring them all at once."""
    name = f"p{next(_names)}"
    events = [
        call(name, 0, 0),
        call(name, 1, 1),
        call(name, 2, 2),
        outcome(name, 3, kind="accepted"),
        outcome(name, 4, kind="persisted", value=False, n=1),
        fb(2, prefix=name, kind="accepted"),
    ]
    for k, i in enumerate(order):
        store(engine, events[i])
        if k in runs_after:
            run_rewards(engine, HALVED, now=BASE_TS.replace(tzinfo=None) + timedelta(seconds=10))
    run_rewards(engine, HALVED, now=LATER)
    # the last call: 0.5 own + 0.5 accepted - 1.0 persisted(false); then halved per step back
    assert rewards(engine, HALVED, name, 3) == [-0.125, -0.25, 0.0]


def test_the_scorer_credits_by_place_in_the_episode():
    ep = Episode("r", BASE_TS, "1", "x", episode_id="e", calls_after=2, episode_calls=3, last_call_ts=BASE_TS)
    assert Scorer(HALVED).credit(ep) == 0.25 and Scorer(EQUAL).credit(ep) == 1.0


def test_the_held_out_slice_keeps_a_task_s_calls_together():
    """Held out by task, not by prompt: an agent's later calls (more turns after the task) and
    the task under another system prompt fall on the side its first call fell on."""
    from pipeline.core.store.training import is_held_out

    for k in range(200):
        task = {"role": "user", "content": f"reverse the word behind key k{k}"}
        calls = [
            [task],
            [{"role": "system", "content": "be brief"}, task],
            [task, {"role": "assistant", "content": "<tool_call>..."}, {"role": "tool", "content": "abc"}],
        ]
        sides = {is_held_out(f"r-{k}-{i}", json.dumps({"prompt": p}), 30.0) for i, p in enumerate(calls)}
        assert len(sides) == 1


def _select(engine, spec, holdout: float = 0.0):
    from pipeline.core.store.training import select_episodes

    return select_episodes(engine, spec.version, holdout_percent=holdout)


def test_a_self_summarizing_call_is_a_call_of_its_episode_credited_and_on_its_task_s_side(engine):
    """Cursor's self-summarization: the agent summarizes its own context (call 1 writes the
    summary) and carries on from it (call 2's prompt is the summary, a new first user message).
    Both are calls of the episode: the outcome credits the summary's tokens, and the summarized
    call trains and is held out with its task (the first call's), in its task's advantage group."""
    summary = "Summary: renaming file_3.py; the tests pass."
    for k in range(40):
        task = [{"role": "user", "content": f"rename file_3.py to task_{k}.py"}]
        store(
            engine,
            call(f"s{k}", 0, 3 * k, prompt=task, completion="<tool_call>..."),
            call(f"s{k}", 1, 3 * k + 1, prompt=task + [{"role": "user", "content": "summarize"}], completion=summary),
            call(f"s{k}", 2, 3 * k + 2, prompt=[{"role": "user", "content": summary}], completion="done"),
            outcome(f"s{k}", 3 * k + 2),
        )
    run_rewards(engine, EQUAL, now=LATER)
    assert rewards(engine, EQUAL, "s0", 3) == [1.0, 1.0, 1.0]  # the summary call credited too
    # every episode's calls fall on one side of the held-out split: its first call's task
    selection = _select(engine, EQUAL, holdout=30.0)
    trained = {r.request_id.split("-r-")[0] for r in selection.rows}
    assert 0 < selection.counts["held_out"] < 120 and selection.counts["held_out"] % 3 == 0
    assert all(sum(r.request_id.startswith(f"{e}-") for r in selection.rows) == 3 for e in trained)
    # and the summarized call's task (grouping) is its episode's
    for e in trained:
        assert len({selection.tasks[r.request_id] for r in selection.rows if r.request_id.startswith(f"{e}-")}) == 1


def test_a_frozen_sub_agent_s_calls_are_context_never_trained(engine):
    """Kimi's frozen sub-agents: calls in the episode served by another model (a policy version
    that is not ours) are rewarded and credited like any call but never selected for training
    (counted `other_policy`); the episode's outcome still credits the calls our policy made."""
    store(
        engine,
        call("k", 0, 0, policy_version="2"),
        call("k", 1, 1, policy_version="searcher-frozen-v7"),
        call("k", 2, 2, policy_version="searcher-frozen-v7"),
        call("k", 3, 3, policy_version="2"),
        outcome("k", 4),
    )
    run_rewards(engine, EQUAL, now=LATER)
    assert rewards(engine, EQUAL, "k", 4) == [1.0, 1.0, 1.0, 1.0]
    selection = _select(engine, EQUAL)
    assert sorted(r.request_id for r in selection.rows) == ["k-r-0", "k-r-3"]
    assert selection.counts["other_policy"] == 2
    from pipeline.core.store.training import select_eval_episodes

    evaluated = select_eval_episodes(engine, EQUAL.version, 100.0, limit=10)  # everything held out
    assert sorted(r.request_id for r in evaluated) == ["k-r-0", "k-r-3"]


def test_an_episode_s_calls_have_a_total_order_when_only_some_carry_a_step():
    """Steps on some calls and not others: compared by step where both had one, else by time,
    three calls could each have one call after them -- no last call, and under discounted credit
    no call undiscounted."""
    from datetime import datetime

    from reward.scoring import _in_episode

    calls = [
        [rid, step, (BASE_TS + timedelta(seconds=k)).isoformat()]
        for k, (rid, step) in enumerate([("a", 2), ("b", None), ("c", 1)], start=1)
    ]
    after = {
        rid: _in_episode(Episode(rid, datetime.fromisoformat(ts), "1", "x"), "e", [], calls).calls_after
        for rid, _, ts in calls
    }
    assert sorted(after.values()) == [0, 1, 2] and after == {"c": 2, "a": 1, "b": 0}  # by step, the unstepped last


def test_two_tenants_episodes_of_one_id_get_their_own_outcomes(engine):
    """Outcomes and sibling calls joined on the episode id alone: two tenants' "task-7" were one
    episode, each credited with the other's outcome. An outcome that names no tenant (a producer
    of before tenants were named) still reaches the episode id in every tenant."""
    store(
        engine,
        call("task-7", 0, 0, tenant="acme", request_id="a-0"),
        call("task-7", 1, 1, tenant="acme", request_id="a-1"),
        call("task-7", 0, 2, tenant="globex", request_id="g-0"),
        dict(outcome("task-7", 5), tenant="acme", event_id="acme-persisted"),
        dict(outcome("task-7", 6, value=False), tenant="globex", event_id="globex-failed"),
    )
    run_rewards(engine, EQUAL, now=LATER)
    value = {rid: stored_reward(engine, rid, EQUAL.version).value for rid in ("a-0", "a-1", "g-0")}
    assert value == {"a-0": 1.0, "a-1": 1.0, "g-0": -1.0}
    assert stored_reward(engine, "g-0", EQUAL.version).outcome["events"] == ["globex-failed"]
    # each tenant's episode has its own calls: acme's two, globex's one (a discounted last call)
    run_rewards(engine, HALVED, now=LATER)
    assert [stored_reward(engine, r, HALVED.version).value for r in ("a-0", "a-1", "g-0")] == [0.5, 1.0, -1.0]
    store(
        engine,
        call("task-9", 0, 7, tenant="acme", request_id="a-9"),
        call("task-9", 0, 8, tenant="globex", request_id="g-9"),
        outcome("task-9", 9),
    )
    run_rewards(engine, EQUAL, now=LATER)
    assert [stored_reward(engine, r, EQUAL.version).value for r in ("a-9", "g-9")] == [1.0, 1.0]  # named: none
    with pytest.raises(ValueError, match="tenants acme, globex each have an episode 'task-9'"):
        explain_episode(engine, EQUAL, "task-9", now=LATER)
    assert [ep.request_id for ep, _, _ in explain_episode(engine, EQUAL, "task-9", now=LATER, tenant="globex")] == [
        "g-9"
    ]
