"""The reward stage against the store (SQLite and PostgreSQL): the delayed-outcome join, late,
orphaned, duplicate and contradictory feedback, ripeness, idempotence, the commands."""

from __future__ import annotations

import itertools
import random
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select

from pipeline.cli import cli
from pipeline.core.store import db as store_db
from pipeline.core.store import tables
from pipeline.core.store.episode_reads import iter_episode_chunks
from pipeline.core.store.events import write_rows
from pipeline.core.store.rewards import stored_reward
from reward.analysis import audit, diff_specs
from reward.spec import DEFAULT_SPEC, load_spec
from reward.stage import run_rewards
from tests.support.factories import BASE_TS, encode, interaction
from tests.support.factories import feedback as fb
from tests.support.stores import store

SPEC = load_spec()
LATER = BASE_TS.replace(tzinfo=None) + timedelta(days=1)  # every episode ripe by the window


def reward_of(engine, request_id):
    row = stored_reward(engine, request_id, SPEC.version)
    return None if row is None else row.value


def test_late_feedback_updates_the_reward(engine):
    store(engine, interaction(1), fb(1, kind="accepted"))
    first = run_rewards(engine, SPEC, now=LATER)
    assert (first.computed, first.updated) == (1, 0) and reward_of(engine, "ev-r-1") == pytest.approx(0.5)
    # ten minutes later the change is reverted
    store(engine, fb(1, kind="persisted", value=False, event_id="ev-f-1-late"))
    second = run_rewards(engine, SPEC, now=LATER)
    assert (second.computed, second.updated) == (0, 1)
    assert reward_of(engine, "ev-r-1") == pytest.approx(0.1)
    third = run_rewards(engine, SPEC, now=LATER)
    assert (third.computed, third.updated, third.unchanged) == (0, 0, 1)


def test_feedback_committed_late_with_a_smaller_id_is_not_missed(engine):
    """Ids are handed out at insert, not at commit: on PostgreSQL a lane's feedback row can
    commit after a reward run has read a newer id another lane committed. Staleness by the newest
    id then missed it for good. (On SQLite writers take turns, so ids follow commits; the case is
    run there too, in commit order.)"""
    from pipeline.core.decoded import from_reference
    from pipeline.core.store.events import Rows, event_row
    from pipeline.core.types import FeedbackEvent, SourcePosition

    def row(i: int, kind: str, value) -> Rows:
        ev = fb(1, kind=kind, value=value, event_id=f"late-{i}")
        rows = Rows()
        rows.add_event(
            event_row(
                from_reference(FeedbackEvent.model_validate(ev)),
                SourcePosition(source="t", partition=i, offset=i),
                encode(ev).decode(),
            )
        )
        return rows

    store(engine, interaction(1), fb(1, kind="accepted"))
    run_rewards(engine, SPEC, now=LATER)
    slow = engine.connect()
    slow_txn = slow.begin()
    late_row = {k: v for k, v in row(2, "persisted", False).feedback[0].items() if k != "type"}
    if engine.dialect.name == "postgresql":  # lane A inserts (its id is taken now) and is slow to commit
        slow.execute(tables.feedback.insert().values(**late_row, ingested_at=LATER))
    write_rows(engine, row(3, "thumbs", 1))  # lane B commits a newer id
    assert run_rewards(engine, SPEC, now=LATER).updated == 1  # reads accepted + thumbs
    if engine.dialect.name != "postgresql":
        slow.execute(tables.feedback.insert().values(**late_row, ingested_at=LATER))
    slow_txn.commit()
    slow.close()
    late = run_rewards(engine, SPEC, now=LATER)
    assert late.updated == 1 and stored_reward(engine, "ev-r-1", SPEC.version).feedback_count == 3
    assert "signal.persisted" in stored_reward(engine, "ev-r-1", SPEC.version).components


def test_a_run_served_since_reads_only_that_window(engine):
    # what a canary's check runs: the episodes served from its start, not the whole history
    store(
        engine,
        interaction(10),
        fb(10, kind="accepted"),
        interaction(3600),
        fb(3600, kind="rejected"),
        fb(3601, kind="accepted"),
        fb(11, kind="accepted"),
    )  # two orphans, one on each side of the cut
    since = BASE_TS.replace(tzinfo=None) + timedelta(seconds=1800)
    window = run_rewards(engine, SPEC, now=LATER + timedelta(days=2), served_since=since)
    assert (window.episodes, window.computed, window.orphaned) == (1, 1, 1)
    assert reward_of(engine, "ev-r-3600") == pytest.approx(-0.5) and reward_of(engine, "ev-r-10") is None
    whole = run_rewards(engine, SPEC, now=LATER + timedelta(days=2))  # the cycle's run: the rest
    assert (whole.episodes, whole.computed, whole.unchanged, whole.orphaned) == (2, 1, 1, 2)
    assert reward_of(engine, "ev-r-10") == pytest.approx(0.5)


def test_orphaned_feedback_waits_is_joined_later_and_reported_after_the_ttl(engine):
    store(engine, fb(2, kind="accepted"))
    report = run_rewards(engine, SPEC, now=LATER)
    assert report.episodes == 0 and report.orphaned == 0  # within the TTL: just waiting
    assert run_rewards(engine, SPEC, now=LATER + timedelta(days=2)).orphaned == 1
    store(engine, interaction(2))  # the interaction finally arrives
    report = run_rewards(engine, SPEC, now=LATER + timedelta(days=2))
    assert report.computed == 1 and report.orphaned == 0
    assert reward_of(engine, "ev-r-2") == pytest.approx(0.5)


def test_a_half_life_decays_feedback_by_its_delay_after_the_interaction(engine):
    # timestamps as stored (text in SQLite, timestamps in PostgreSQL) give the delay
    spec = SPEC.model_validate(
        {**SPEC.model_dump(), "name": "decaying", "signals": {"followup": {"weight": 0.3, "half_life_s": 600}}}
    )
    store(engine, interaction(9), fb(9, kind="followup", ts="2026-11-01T00:10:09Z"))  # 600 s after it
    run_rewards(engine, spec, now=LATER)
    assert stored_reward(engine, "ev-r-9", spec.version).value == pytest.approx(-0.15)


def test_duplicate_feedback_events_count_once(engine):
    store(engine, interaction(3), fb(3, kind="tool_error"), fb(3, kind="tool_error"), fb(3, kind="tool_error"))
    run_rewards(engine, SPEC, now=LATER)
    assert reward_of(engine, "ev-r-3") == pytest.approx(-0.4)  # tool_error sums, but one event


def test_contradictory_feedback_accepted_then_reverted(engine):
    store(
        engine,
        interaction(4),
        fb(4, kind="accepted"),
        fb(4, kind="persisted", value=False, event_id="revert", ts="2026-11-01T00:20:00Z"),
    )
    run_rewards(engine, SPEC, now=LATER)
    row = stored_reward(engine, "ev-r-4", SPEC.version)
    assert row.value == pytest.approx(0.1)
    assert row.components == {"signal.accepted": 0.5, "signal.persisted": -0.4}


def test_unripe_episodes_wait_for_the_window_or_a_terminal_signal(engine):
    store(engine, interaction(5), fb(5, kind="accepted"), interaction(6), fb(6, kind="rejected"))
    t = BASE_TS.replace(tzinfo=None) + timedelta(seconds=60)
    report = run_rewards(engine, SPEC, now=t)
    assert report.unripe == 1 and report.computed == 1  # 6 has a terminal "rejected"
    assert reward_of(engine, "ev-r-5") is None and reward_of(engine, "ev-r-6") == pytest.approx(-0.5)
    assert run_rewards(engine, SPEC, now=t + timedelta(hours=2)).computed == 1


def test_arrival_order_does_not_change_rewards(tmp_path):
    events = [
        interaction(7),
        fb(7, kind="accepted"),
        fb(7, kind="thumbs", value=False, event_id="t7"),
        fb(7, kind="edited", payload={"text": "x"}, event_id="e7"),
    ]
    results = set()
    for i, order in enumerate(itertools.islice(itertools.permutations(events), 0, 24, 5)):
        # each arrival order into its own store, rewards computed after every arrival
        url = f"sqlite:///{tmp_path / f'p{i}.db'}"
        store_db.upgrade(url)
        eng = store_db.make_engine(url)
        for ev in order:
            store(eng, ev)
            run_rewards(eng, SPEC, now=LATER)
        results.add(round(reward_of(eng, "ev-r-7"), 12))
        eng.dispose()
    assert len(results) == 1


def test_reward_commands(engine, db_url, tmp_path):
    store(engine, interaction(8, completion=""), fb(8, kind="thumbs", value=True))
    env = {"RTRL_DB_URL": db_url, "RTRL_STATE_DIR": str(tmp_path)}
    run = CliRunner().invoke(cli, ["reward", "run"], env=env)
    assert run.exit_code == 0 and "1 rewards computed" in run.output, run.output
    out = CliRunner().invoke(cli, ["reward", "explain", "ev-r-8"], env=env)
    assert out.exit_code == 0, out.output
    assert "guard.abstention" in out.output and "signal.thumbs" in out.output and "= reward" in out.output
    assert "thumbs       1      0 s after" in out.output, out.output  # the delay after the interaction
    missing = CliRunner().invoke(cli, ["reward", "explain", "nope"], env=env)
    assert missing.exit_code != 0 and "no interaction with request_id 'nope'" in missing.output
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[signals.accepted]\nweight = 99\n')
    refused = CliRunner().invoke(cli, ["reward", "run", "--spec", str(bad)], env=env)
    assert refused.exit_code != 0 and "signals.accepted.weight" in refused.output


def _naive_spec(tmp_path):
    """The default spec without the abstention guard: the spec that invites the hack."""
    text = (
        Path(DEFAULT_SPEC)
        .read_text()
        .replace('name = "default"', 'name = "naive"')
        .replace("[guards.abstention]\npenalty = 0.6", "[guards.abstention]\npenalty = 0.0")
    )
    path = tmp_path / "naive.toml"
    path.write_text(text)
    return path


def test_diff_recompute_and_audit(engine, db_url, tmp_path):
    store(
        engine,
        interaction(10, completion=""),
        fb(10, kind="thumbs", value=True),  # abstains, praised
        interaction(11),
        fb(11, kind="accepted"),
        fb(11, kind="followup", event_id="fu11"),
        interaction(
            12,
            policy_version="2",
            completion=[
                {"role": "assistant", "content": "", "tool_calls": [{"name": "ls", "arguments": "{"}]},
                {"role": "tool", "content": "error"},
                {"role": "assistant", "content": "done"},
            ],
        ),
        fb(12, kind="tool_error"),
    )
    env = {"RTRL_DB_URL": db_url, "RTRL_STATE_DIR": str(tmp_path)}
    naive = _naive_spec(tmp_path)
    d = diff_specs(engine, SPEC, load_spec(naive), now=LATER)
    assert d.new.n == 3 and d.sign_changes == 1 and d.changed == 1
    assert d.contributions["guard.abstention"] == [pytest.approx(-0.6), 0.0]
    ((delta, request_id, old, new),) = [m for m in d.movers if m[0] > 0]
    assert request_id == "ev-r-10" and (old, new) == (pytest.approx(-0.3), pytest.approx(0.3))
    out = CliRunner().invoke(cli, ["reward", "diff", "--spec", str(naive)], env=env)
    assert out.exit_code == 0 and "sign changed: 1" in out.output and "ev-r-10" in out.output, out.output
    # recompute under the new spec keeps the old version's rewards
    assert CliRunner().invoke(cli, ["reward", "run"], env=env).exit_code == 0
    rec = CliRunner().invoke(cli, ["reward", "recompute", "--spec", str(naive)], env=env)
    assert rec.exit_code == 0 and "3 rewards computed" in rec.output, rec.output
    assert stored_reward(engine, "ev-r-10", load_spec(naive).version).value == pytest.approx(0.3)
    assert reward_of(engine, "ev-r-10") == pytest.approx(-0.3)
    again = CliRunner().invoke(cli, ["reward", "recompute", "--spec", str(naive)], env=env)
    assert "0 rewards computed, 3 scored again" in again.output, again.output
    canaries = audit(engine, SPEC)
    assert canaries["1"].rates() == {
        "abstention_rate": 0.5,
        "mean_length": pytest.approx(len(interaction(11)["completion"]) / 2),
        "tool_error_rate": 0.0,
        "accept_rate": 0.5,
        "followup_rate": 0.5,
    }
    assert canaries["2"].rates()["tool_error_rate"] == 1.0 and canaries["2"].episodes == 1
    table = CliRunner().invoke(cli, ["reward", "audit"], env=env)
    assert table.exit_code == 0 and "50.0%" in table.output and "100.0%" in table.output, table.output


def test_late_feedback_after_training_keeps_the_lineage_and_is_counted(engine):
    from sqlalchemy import insert, select

    from pipeline.core.store.tables import training_episodes

    store(engine, interaction(30), fb(30, kind="accepted"))
    run_rewards(engine, SPEC, now=LATER)
    with engine.begin() as conn:  # a training run used it (what the training stage records)
        conn.execute(
            insert(training_episodes).values(
                run_id="run-1", request_id="ev-r-30", spec_version=SPEC.version, reward=0.5, used_at=LATER
            )
        )
    store(engine, fb(30, kind="followup", event_id="late-30"))
    report = run_rewards(engine, SPEC, now=LATER)
    assert report.updated == 1 and report.changed_after_training == 1
    assert reward_of(engine, "ev-r-30") == pytest.approx(0.2)
    with engine.connect() as conn:
        assert conn.scalar(select(training_episodes.c.reward).where(training_episodes.c.run_id == "run-1")) == 0.5


def test_two_interactions_for_one_request_make_one_episode(engine):
    store(engine, interaction(40), interaction(40, event_id="ev-i-40-again", completion=""), fb(40, kind="accepted"))
    report = run_rewards(engine, SPEC, now=LATER)
    assert (report.computed, report.duplicate_interactions) == (1, 1)
    assert reward_of(engine, "ev-r-40") == pytest.approx(0.5)  # the first interaction, not the empty one


def test_workers_split_a_run_and_write_what_one_process_writes(engine):
    """`workers=2` over small chunks: every episode is scored once, by one of the worker
    processes, to the same value and components one process gives (force rewrites them)."""
    rng = random.Random(7)
    events = []
    for i in range(300, 420):
        events.append(interaction(i, prefix="w"))
        for j in range(rng.randrange(4)):
            kind = rng.choice(["accepted", "rejected", "edited", "persisted", "tool_error", "csat"])
            events.append(
                fb(
                    i,
                    prefix="w",
                    kind=kind,
                    value=rng.choice([True, False, 0.5]),
                    event_id=f"w-f-{i}-{j}",
                    payload={"text": "x = 1"},
                )
            )
    events.append(interaction(300, prefix="w", event_id="w-i-300-again"))  # a duplicate interaction
    store(engine, *events)

    def rewards():
        with engine.connect() as conn:
            return {
                r.request_id: (r.value, r.components, r.last_feedback_id)
                for r in conn.execute(select(tables.rewards).where(tables.rewards.c.spec_version == SPEC.version))
            }

    parallel = run_rewards(engine, SPEC, now=LATER, workers=2, chunk=16)
    by_workers = rewards()
    assert (parallel.episodes, parallel.computed, parallel.duplicate_interactions) == (120, 120, 1)
    assert parallel.ignored_kinds.get("csat", 0) > 0
    single = run_rewards(engine, SPEC, now=LATER, force=True)
    assert (single.episodes, single.updated, single.duplicate_interactions) == (120, 120, 1)
    assert single.value_sum == pytest.approx(parallel.value_sum)
    assert rewards() == by_workers
    assert run_rewards(engine, SPEC, now=LATER, workers=2, chunk=16).unchanged == 120


def test_an_incremental_run_reads_only_episodes_whose_reward_is_stale(engine):
    store(
        engine,
        interaction(500),
        fb(500, kind="accepted"),
        interaction(501),
        fb(501, kind="accepted"),
        interaction(502),
        interaction(502, event_id="ev-i-502-again"),
    )
    run_rewards(engine, SPEC, now=LATER)

    def stale():
        chunks = list(iter_episode_chunks(engine, SPEC.version, only_stale=True))
        return [r.request_id for c in chunks for r in c.interactions], sum(c.current for c in chunks)

    # 502 has no feedback: ripe by the window, rewarded, current; its second interaction is not an episode
    assert stale() == ([], 3)
    store(engine, fb(501, kind="persisted", value=False, event_id="ev-f-501-late"))
    assert stale() == (["ev-r-501"], 2)
    report = run_rewards(engine, SPEC, now=LATER)
    assert (report.episodes, report.updated, report.unchanged, report.duplicate_interactions) == (3, 1, 2, 1)
    assert stale() == ([], 3)


def test_a_failed_write_stops_the_run_and_counts_only_what_was_stored(engine, monkeypatch):
    """A chunk's upsert runs on a writer thread while the next chunk is scored: its error
    still ends the run, the chunks before it stay stored, and progress never counted it."""
    import reward.scoring as stage  # where the scoring loop writes

    store(engine, *[ev for i in range(600, 640) for ev in (interaction(i), fb(i, kind="accepted"))])
    calls, progress = [], []
    real = stage.upsert_rewards

    def upsert(engine_, version, rows):
        calls.append(len(rows))
        if len(calls) == 2:
            raise RuntimeError("disk full")
        real(engine_, version, rows)

    monkeypatch.setattr(stage, "upsert_rewards", upsert)
    with pytest.raises(RuntimeError, match="disk full"):
        run_rewards(engine, SPEC, now=LATER, chunk=16, on_progress=lambda r: progress.append(r.computed))
    assert progress == [16]
    with engine.connect() as conn:
        assert len(conn.execute(select(tables.rewards.c.request_id)).all()) == 16
    monkeypatch.setattr(stage, "upsert_rewards", real)
    assert run_rewards(engine, SPEC, now=LATER, chunk=16).computed == 24  # the rest, next time


def test_a_feedback_value_the_store_cannot_give_back_skips_its_episode_not_the_run(engine):
    """A value at the float limit, stored before the contract refused it: SQLite's JSON prints
    it with 15 digits, which reads back as infinity -- the run used to stop there."""
    from pipeline.core.store.events import Rows, event_row
    from pipeline.core.types import FeedbackEvent, SourcePosition

    store(engine, interaction(1), fb(1, kind="accepted"), interaction(2), fb(2, kind="accepted"))
    big = fb(2, kind="thumbs", value=1.0, event_id="big")
    row = event_row(
        FeedbackEvent.model_validate(big), SourcePosition(source="t", partition=0, offset=999), encode(big).decode()
    )
    row["value"] = 1.7976931348623157e308
    rows = Rows()
    rows.add_event(row)
    write_rows(engine, rows)
    report = run_rewards(engine, SPEC, now=LATER)
    if engine.dialect.name == "sqlite":
        assert report.unusable == 1 and report.computed == 1 and "could not be read" in report.summary()
    else:  # PostgreSQL prints floats exactly: the episode is read
        assert report.unusable == 0 and report.computed == 2
