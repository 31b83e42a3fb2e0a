"""Incremental reward runs (SQLite and PostgreSQL): a run reads only what is new -- the ids after
the settled ones, and the settled episodes that new feedback or a new call names -- and still
reports, and stores, what a run over the whole history would."""

from __future__ import annotations

import itertools
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete, select

import reward.scoring
from ingest.batch import decode_records
from pipeline.core.store import tables
from pipeline.core.store.events import write_rows
from pipeline.core.store.reward_progress import load_progress
from pipeline.core.store.rewards import orphaned_feedback
from reward.spec import parse_spec
from reward.stage import run_rewards
from tests.support.factories import BASE_TS, encode, interaction
from tests.support.factories import feedback as fb

T0 = BASE_TS.replace(tzinfo=None)
LATER = T0 + timedelta(days=1)
_SPEC = """
[ripeness]
window_s = 100
[episode]
credit = "discounted"
gamma = 0.5
window_s = 100
[signals.accepted]
weight = 0.5
[signals.persisted]
weight = 1.0
[signals.thumbs]
weight = 0.3
"""
SPEC = parse_spec('name = "incremental"\n' + _SPEC)
WHOLE = parse_spec('name = "whole-history"\n' + _SPEC)  # the same rules, another version: the reference
_COUNTS = (
    "episodes",
    "computed",
    "updated",
    "unchanged",
    "unripe",
    "duplicate_interactions",
    "unusable",
    "unfinished_episodes",
    "orphaned",
    "judge_deferred",
)
_offsets = itertools.count()


def store(engine, *events):
    write_rows(engine, decode_records([("t", 0, next(_offsets), encode(ev)) for ev in events], 1 << 20).rows)


@pytest.fixture
def reads(monkeypatch):
    """How many episodes the runs read (built from a stored row), reset by the caller."""
    count = [0]
    real = reward.scoring.read_episode

    def counting(row):
        count[0] += 1
        return real(row)

    monkeypatch.setattr(reward.scoring, "read_episode", counting)
    return count


def test_a_run_with_nothing_new_reads_no_episode_and_reports_the_history(engine, reads):
    store(
        engine,
        *[ev for i in range(40) for ev in (interaction(i), fb(i, kind="accepted"))],
        interaction(7, event_id="ev-i-7-again"),
        fb(999, kind="accepted"),
    )  # a duplicate, an orphan
    first = run_rewards(engine, SPEC, now=LATER, chunk=16)
    assert (first.episodes, first.computed, first.duplicate_interactions, reads[0]) == (40, 40, 1, 40)
    reads[0] = 0
    again = run_rewards(engine, SPEC, now=LATER, chunk=16)
    assert reads[0] == 0
    assert (again.episodes, again.unchanged, again.computed, again.duplicate_interactions) == (40, 40, 0, 1)
    # late feedback on a settled episode, and a new one: those two are read, and only they
    store(engine, fb(3, kind="persisted", value=False, event_id="late-3"), interaction(40), fb(40, kind="accepted"))
    third = run_rewards(engine, SPEC, now=LATER, chunk=16)
    assert reads[0] == 2
    assert (third.episodes, third.updated, third.computed, third.unchanged) == (41, 1, 1, 39)
    assert load_progress(engine, SPEC.version).settled_below > _max_id(engine)


def test_the_first_unripe_episode_holds_the_settled_ids_back_until_it_ripens(engine, reads):
    store(engine, *[interaction(i) for i in range(10)])
    early = run_rewards(engine, SPEC, now=T0 + timedelta(seconds=104.5))  # ripe: served at 0..4 s
    assert (early.computed, early.unripe) == (5, 5)
    assert load_progress(engine, SPEC.version).settled_below == _first_id_of(engine, "ev-r-5")
    reads[0] = 0
    later = run_rewards(engine, SPEC, now=LATER)
    assert (later.computed, later.unchanged, later.unripe, reads[0]) == (5, 5, 0, 5)


def test_a_settled_call_is_read_again_when_its_agent_episode_gains_a_call(engine):
    calls = [interaction(i, prefix="a", episode_id="a", step=i) for i in range(3)]
    store(engine, *calls[:2])
    run_rewards(engine, SPEC, now=LATER)  # ripe by the window: both settled
    store(engine, calls[2])  # a late call: the others are no longer the episode's end
    report = run_rewards(engine, SPEC, now=T0 + timedelta(seconds=50))  # the episode is unripe again
    assert (report.unripe, report.updated) == (3, 0)
    assert load_progress(engine, SPEC.version).pending == ["a-r-0", "a-r-1"]
    outcome = fb(9, prefix="a", kind="persisted", event_id="a-outcome", episode_id="a")
    del outcome["request_id"]
    store(engine, outcome)
    report = run_rewards(engine, SPEC, now=T0 + timedelta(seconds=50))  # ripe by its terminal outcome
    assert (report.updated, report.computed, report.unripe) == (2, 1, 0)
    assert _reward(engine, SPEC, "a-r-0") == pytest.approx(0.25)  # two calls after it: a quarter


def test_a_forced_run_reads_everything_and_settles_it(engine, reads):
    store(engine, *[ev for i in range(20) for ev in (interaction(i), fb(i, kind="accepted"))])
    run_rewards(engine, SPEC, now=LATER)
    reads[0] = 0
    forced = run_rewards(engine, SPEC, now=LATER, force=True)
    assert (forced.updated, forced.episodes, reads[0]) == (20, 20, 20)
    reads[0] = 0
    assert run_rewards(engine, SPEC, now=LATER).unchanged == 20 and reads[0] == 0


def test_an_unusable_episode_is_counted_in_every_run_but_read_once(engine, reads):
    """A feedback value at the float limit, stored before the contract refused it, reads back
    as infinity from SQLite's JSON (PostgreSQL prints it exactly): its episode is unusable."""
    from pipeline.core.store.events import Rows, event_row
    from pipeline.core.types import FeedbackEvent, SourcePosition

    if engine.dialect.name != "sqlite":
        pytest.skip("PostgreSQL gives the value back")
    store(engine, interaction(1), fb(1, kind="accepted"), interaction(2), fb(2, kind="accepted"))
    big = fb(2, kind="thumbs", value=1.0, event_id="big")
    row = event_row(
        FeedbackEvent.model_validate(big), SourcePosition(source="t", partition=0, offset=10**6), encode(big).decode()
    )
    row["value"] = 1.7976931348623157e308
    rows = Rows()
    rows.add_event(row)
    write_rows(engine, rows)
    first = run_rewards(engine, SPEC, now=LATER)
    assert (first.unusable, first.computed, first.episodes) == (1, 1, 2)
    reads[0] = 0
    again = run_rewards(engine, SPEC, now=LATER)
    assert (again.unusable, again.unchanged, again.episodes, reads[0]) == (1, 1, 2, 0)
    store(engine, fb(2, kind="accepted", event_id="more-2"))  # named again: read again, still unusable
    third = run_rewards(engine, SPEC, now=LATER)
    assert (third.unusable, third.unchanged, third.episodes, reads[0]) == (1, 1, 2, 1)


def test_an_interaction_committed_late_with_a_smaller_id_is_not_settled_past(engine, monkeypatch):
    """On PostgreSQL an id is taken at insert: a lane slow to commit holds a smaller id than one
    another lane committed before the run. The run waits for it under the SHARE lock, here past
    the lock's timeout: that run reads the whole history and settles nothing, and the next one
    finds the late interaction. (SQLite's writers take turns: the same steps, in commit order.)"""
    import pipeline.core.store.watermarks as watermarks

    monkeypatch.setattr(watermarks, "LOCK_TIMEOUT_S", 0.2)
    slow = engine.connect()
    slow_txn = slow.begin()
    late = decode_records([("t", 0, next(_offsets), encode(interaction(70)))], 1 << 20).rows.interaction[0]
    late = {k: v for k, v in late.items() if k != "type"}
    postgres = engine.dialect.name == "postgresql"
    if postgres:  # lane A inserts (its id is taken now) and is slow to commit
        slow.execute(tables.interactions.insert().values(**late, ingested_at=LATER))
    store(engine, interaction(71))  # lane B commits a newer id
    assert run_rewards(engine, SPEC, now=LATER).computed == 1
    if not postgres:
        slow.execute(tables.interactions.insert().values(**late, ingested_at=LATER))
    slow_txn.commit()
    slow.close()
    report = run_rewards(engine, SPEC, now=LATER)
    assert (report.computed, report.episodes) == (1, 2) and _reward(engine, SPEC, "ev-r-70") is not None


def test_a_role_that_may_not_lock_the_event_tables_gets_whole_history_runs(empty_db_url):
    """SHARE locks need more than SELECT on a table: a reward role that may only read the events
    runs as before incremental runs, over the whole history, and settles nothing."""
    from pipeline.core.store import db as store_db
    from tests.support.scratch_db import restricted_role

    if not empty_db_url.startswith("postgresql"):
        pytest.skip("a PostgreSQL privilege")
    store_db.upgrade(empty_db_url)
    admin = store_db.make_engine(empty_db_url)
    store(admin, interaction(1), fb(1, kind="accepted"))
    admin.dispose()
    with restricted_role(
        empty_db_url,
        [
            "GRANT CONNECT ON DATABASE {database} TO {role}",
            "GRANT USAGE ON SCHEMA public TO {role}",
            "GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}",
            "GRANT INSERT, UPDATE ON rewards, reward_progress TO {role}",
            "GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}",
        ],
    ) as engine:
        assert run_rewards(engine, SPEC, now=LATER).computed == 1
        assert run_rewards(engine, SPEC, now=LATER).unchanged == 1
        assert load_progress(engine, SPEC.version).settled_below == 0


# --- the differential test: incremental runs against runs over the whole history ----------------

_KINDS = ["accepted", "persisted", "thumbs", "rejected"]


@st.composite
def _event(draw, counter=itertools.count()):  # noqa: B008 -- one counter shared by every draw: unique ids
    n = next(counter)
    i = draw(st.integers(0, 7))  # a request, or a call of one of two agent episodes
    at = draw(st.integers(0, 300))
    kind = draw(st.sampled_from(["call", "call", "feedback", "feedback", "outcome", "again", "orphan"]))
    ts = (BASE_TS + timedelta(seconds=at)).isoformat().replace("+00:00", "Z")
    episode = {"episode_id": f"e{i % 2}", "step": i // 2} if i >= 4 else {}
    if kind == "call":
        return interaction(i, prefix="d", ts=ts, **episode)
    if kind == "again":  # a second interaction for a request: never an episode of its own
        return interaction(i, prefix="d", ts=ts, event_id=f"d-again-{n}", **episode)
    value = draw(st.sampled_from([True, False]))
    if kind == "outcome":
        ev = fb(
            i,
            prefix="d",
            kind=draw(st.sampled_from(_KINDS)),
            value=value,
            ts=ts,
            event_id=f"d-o-{n}",
            episode_id=f"e{i % 2}",
        )
        del ev["request_id"]
        return ev
    request = f"d-r-{i}" if kind == "feedback" else f"nobody-{n}"
    return fb(
        i, prefix="d", kind=draw(st.sampled_from(_KINDS)), value=value, ts=ts, event_id=f"d-f-{n}", request_id=request
    )


_steps = st.lists(
    st.one_of(
        st.lists(_event(), min_size=1, max_size=4).map(lambda evs: ("store", evs)),
        st.sampled_from([50, 200, 350, 86400 * 3]).map(lambda s: ("run", s)),
    ),
    min_size=4,
    max_size=12,
)


@settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(steps=_steps)
def test_incremental_runs_store_and_report_what_whole_history_runs_do(engine, steps):
    """Calls, repeats, feedback, episode outcomes and orphans stored in any order, reward runs in
    between at times that go back and forth (a call unripe again, a window not yet passed): after
    every run, the incremental spec's report and rewards are those of the same rules run over
    the whole history (its progress removed before each run), and its orphan count is that of
    the query over the whole history."""
    _clear(engine)
    for what, arg in steps + [("run", 86400 * 3)]:
        if what == "store":
            store(engine, *arg)
            continue
        now = T0 + timedelta(seconds=arg)
        incremental = run_rewards(engine, SPEC, now=now, chunk=4)
        with engine.begin() as conn:
            conn.execute(delete(tables.reward_progress).where(tables.reward_progress.c.spec_version == WHOLE.version))
        whole = run_rewards(engine, WHOLE, now=now, chunk=4)
        assert {c: getattr(incremental, c) for c in _COUNTS} == {c: getattr(whole, c) for c in _COUNTS}
        assert incremental.orphaned == orphaned_feedback(engine, now - timedelta(seconds=SPEC.join.orphan_ttl_s))
        assert _rewards(engine, SPEC) == _rewards(engine, WHOLE)


def _clear(engine):
    with engine.begin() as conn:
        for table in (tables.rewards, tables.reward_progress, tables.feedback, tables.interactions):
            conn.execute(delete(table))


def _rewards(engine, spec):
    with engine.connect() as conn:
        return {
            r.request_id: (round(r.value, 9), r.components, r.feedback_count)
            for r in conn.execute(select(tables.rewards).where(tables.rewards.c.spec_version == spec.version))
        }


def _reward(engine, spec, request_id):
    return _rewards(engine, spec)[request_id][0]


def _max_id(engine):
    with engine.connect() as conn:
        return conn.scalar(select(tables.interactions.c.id).order_by(tables.interactions.c.id.desc()).limit(1))


def _first_id_of(engine, request_id):
    with engine.connect() as conn:
        return conn.scalar(
            select(tables.interactions.c.id)
            .where(tables.interactions.c.request_id == request_id)
            .order_by(tables.interactions.c.id)
            .limit(1)
        )
