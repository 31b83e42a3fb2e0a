"""kill -9 an `rtrl daemon` process in the middle of training, restart it, kill -9 it again in
the middle of a promotion (the registry's champion alias moved, its audit row still pending),
restart it: the cycle completes exactly once -- one finished training run, one registry version,
one audit row done and published, one model-update event -- and every event sent is stored once.

The daemons freeze at named points (pipeline/core/faults.py) so the test can kill them there from
outside: a crash at an exact instant, without racing a promotion that lasts milliseconds."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path

import pytest
from kafka import KafkaConsumer
from sqlalchemy import func, select

from deploy.registry import CANARY, CHAMPION, Registry
from pipeline.core.store.events import utcnow
from pipeline.core.store.tables import (
    alias_moves,
    cycles,
    feedback,
    gate_decisions,
    interactions,
    rewards,
    training_runs,
)
from pipeline.kafka_local import ensure_topics
from tests.support import reverse_task as task
from tests.support.factories import BASE_TS, served_now
from tests.support.helpers import REPO, free_port, wait_for
from tests.support.kafka_events import produce_events
from train.models import load_policy

pytestmark = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # the lease: test_daemon

MODEL = "crash-policy"


def _stopped_aside(rows: list) -> list:
    """The cycles that finished. With `cycle.every = 1s` one more cycle is often under way when
    the test's SIGTERM arrives: shutdown stops it before its next stage, and it waits, unfinished
    and having trained nothing, for the next start to resume it (at most one such)."""
    unfinished = [r for r in rows if r.state in ("pending", "rewarding", "training")]
    assert len(unfinished) <= 1 and all(r.run_id is None for r in unfinished), unfinished
    return [r for r in rows if r not in unfinished]


_STARTED: list[subprocess.Popen] = []  # every daemon a test started: none outlives its test


@pytest.fixture(autouse=True)
def _no_daemon_left():
    yield
    while _STARTED:  # a test that failed half-way leaves its daemons running (they would cycle on)
        proc = _STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _events(reverse_base: Path, prefix: str, seed: int, limit: int | None = None) -> list[dict]:
    policy = load_policy(reverse_base, device="cpu")
    prompts, _ = task.split()
    episodes = task.sample_episodes(policy.model, policy.tokenizer, prompts[:limit], per_prompt=2, seed=seed)
    return task.as_events(episodes, prefix, utcnow().replace(tzinfo=BASE_TS.tzinfo) - timedelta(hours=2))


def _wait_for(predicate, timeout: float, what: str, procs=()):
    def check():
        for p in procs:
            assert p.poll() is None, f"the daemon exited with {p.returncode} while waiting for {what}"
        return predicate()

    wait_for(check, timeout, what, interval=0.2)


def _start(
    env: dict, tmp_path: Path, name: str, pause: str | None = None, pause_s: float | None = None
) -> subprocess.Popen:
    """An `rtrl daemon` process; with `pause`, it freezes at that fault point (and says so in a
    file), forever or for `pause_s` seconds."""
    faults = {"RTRL_FAULT_PAUSE": pause, "RTRL_FAULT_MARKER": str(tmp_path / f"{name}.paused")} if pause else {}
    if pause_s is not None:
        faults["RTRL_FAULT_PAUSE_S"] = str(pause_s)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "daemon", "--lease-ttl", "3", "--metrics-port", str(free_port())],
        env={**env, **faults},
        cwd=REPO,
        stdout=open(tmp_path / f"{name}.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    _STARTED.append(proc)
    return proc


def _kill_9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def _model_updates(kafka_bootstrap: str, topic: str) -> list[dict]:
    consumer = KafkaConsumer(
        topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=3000
    )
    updates = [json.loads(m.value) for m in consumer]
    consumer.close()
    return updates


def _config(tmp_path: Path, reverse_base: Path, tracking: str, gate: str = "min_ess = 5", extra: str = "") -> Path:
    config = tmp_path / "rtrl.toml"
    config.write_text(f"""
[train]
base_model = "{reverse_base}"
learning_rate = 5e-3
epochs = 8
batch_tokens = 1024
max_seq_len = 64
lora_r = 8
lora_alpha = 16
holdout_percent = 30.0
[gate]
max_new_tokens = 3
{gate}
max_kl = 5.0
generate_prompts = 40
[gate.bounds.smoke_latency_ms]
max_rel_increase = 50.0
[cycle]
every = "1s"
min_new_episodes = 20
[mlflow]
tracking_uri = "{tracking}"
registered_model = "{MODEL}"
{extra}""")
    return config


def test_kill_9_in_training_and_in_promotion_then_the_cycle_completes_exactly_once(
    cfg_env, engine, kafka_bootstrap, topics, reverse_base, tmp_path
):
    updates_topic = f"t-{uuid.uuid4().hex[:8]}.model-updates"
    ensure_topics(kafka_bootstrap, [updates_topic], partitions=1)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # the gate's improvement bound off: this test is about finishing a cycle exactly once, and a
    # candidate whose bound lands just below 0 (it happened: -0.02) would never reach the promotion
    config = _config(tmp_path, reverse_base, tracking, gate="min_ess = 5\nmin_improvement = -1.0")
    env = {**os.environ, **cfg_env, "RTRL_CONFIG": str(config), "RTRL_KAFKA__MODEL_UPDATES_TOPIC": updates_topic}

    def start(name: str, pause: str | None = None) -> subprocess.Popen:
        return _start(env, tmp_path, name, pause)

    def the_cycle():
        with engine.connect() as conn:
            return conn.execute(select(cycles).where(cycles.c.state != "skipped")).all()

    first = _events(reverse_base, "a", seed=8)
    produce_events(kafka_bootstrap, topics, first)
    daemons = []
    try:
        # 1. killed while training
        a = start("a", pause="train.step")
        daemons.append(a)
        _wait_for((tmp_path / "a.paused").exists, 240, "daemon a to reach a training step", [a])
        [row] = the_cycle()
        assert row.state == "training"
        _kill_9(a)

        # more traffic while no daemon runs: a few new events and a resend of ones already stored
        late = _events(reverse_base, "b", seed=9, limit=4)
        produce_events(kafka_bootstrap, topics, late + first[:10])

        # 2. the restarted daemon resumes the cycle and is killed between the champion alias and its audit row
        b = start("b", pause="promote.champion_moved")
        daemons.append(b)
        _wait_for((tmp_path / "b.paused").exists, 300, "daemon b to reach the promotion", [b])
        [row] = the_cycle()
        assert row.state == "promoting" and row.candidate_version == "1"
        registry = Registry(tracking, MODEL, engine)
        assert registry.alias(CHAMPION).version == "1"  # moved in the registry...
        with engine.connect() as conn:  # ...not yet in the audit table
            assert [m.status for m in conn.execute(select(alias_moves))] == ["pending"]
        _kill_9(b)

        # 3. the next start finishes it, once, and goes on skipping (nothing new)
        c = start("c")
        daemons.append(c)

        def settled() -> bool:
            with engine.connect() as conn:
                skipped_after = conn.execute(
                    select(func.count()).select_from(cycles).where(cycles.c.state == "skipped")
                ).scalar()
                rewarded = conn.execute(select(func.count()).select_from(rewards)).scalar()
            # every interaction rewarded (the late ones by the skipped cycles): before SIGTERM,
            # which stops a running cycle where it is rather than letting it finish
            return the_cycle()[0].state == "done" and skipped_after >= 2 and rewarded == interactions_sent

        interactions_sent = len({e["event_id"] for e in first + late if e["type"] == "interaction"})
        _wait_for(settled, 240, "the cycle to complete, the next ones to skip and every interaction rewarded", [c])
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    assert c.returncode == 0  # SIGTERM: a clean exit

    [row] = _stopped_aside(the_cycle())  # exactly one cycle trained, gated and promoted; no second one
    assert row.state == "done" and row.promoted == 1 and row.candidate_version == "1", row.reason
    with engine.connect() as conn:
        runs = dict(conn.execute(select(training_runs.c.run_id, training_runs.c.status)).all())
        moves = conn.execute(select(alias_moves)).all()
        decisions = conn.execute(select(gate_decisions.c.run_id, gate_decisions.c.passed)).all()
        stored = {t.name: conn.execute(select(func.count()).select_from(t)).scalar() for t in (interactions, feedback)}
        reward_rows = conn.execute(select(rewards.c.request_id)).scalars().all()
    assert sorted(runs.values()) == ["failed", "finished"]  # the killed run, the one that counts
    assert runs[row.run_id] == "finished"
    assert [(d.run_id, bool(d.passed)) for d in decisions] == [(row.run_id, True)]

    # the registry and the audit table agree; the model-update event went out once
    registry = Registry(tracking, MODEL, engine)
    assert [v.version for v in registry.list()] == ["1"] and registry.alias(CHAMPION).version == "1"
    assert [(m.to_version, m.status, m.published_at is not None) for m in moves] == [("1", "done", True)]
    updates = _model_updates(kafka_bootstrap, updates_topic)
    assert [(u["name"], u["version"]) for u in updates] == [(MODEL, "1")]

    # no event lost or stored twice (the resent ones deduplicated), one reward per interaction
    sent = {e["event_id"]: e["type"] for e in first + late}
    assert stored == {
        "interactions": list(sent.values()).count("interaction"),
        "feedback": list(sent.values()).count("feedback"),
    }
    assert len(reward_rows) == len(set(reward_rows)) == stored["interactions"]


def test_kill_9_after_a_canary_is_decided_then_it_is_promoted_once(
    cfg_env, engine, kafka_bootstrap, topics, reverse_base, tmp_path
):
    """A staged rollout: the daemon stages the candidate, live traffic arrives, the online
    comparison is recorded -- and the daemon dies before acting on it. The next daemon reuses
    that decision (no second comparison on more traffic), promotes once and clears the canary."""
    updates_topic = f"t-{uuid.uuid4().hex[:8]}.model-updates"
    ensure_topics(kafka_bootstrap, [updates_topic], partitions=1)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    # outcomes final 1 s after the interaction, so the online traffic below settles at once
    spec = (REPO / "reward" / "default_spec.toml").read_text().replace("window_s = 3600", "window_s = 1")
    (tmp_path / "spec.toml").write_text(spec)
    config = _config(
        tmp_path,
        reverse_base,
        tracking,
        gate="min_ess = 2\nmin_improvement = -1.0",
        extra=f"""
[reward]
spec = "{tmp_path / "spec.toml"}"
[rollout]
share = 0.5
min_requests = 40
check_every = "1s"
max_wait = "1h"
""",
    )
    env = {**os.environ, **cfg_env, "RTRL_CONFIG": str(config), "RTRL_KAFKA__MODEL_UPDATES_TOPIC": updates_topic}

    def the_cycle():
        with engine.connect() as conn:
            return conn.execute(select(cycles).where(cycles.c.state != "skipped")).all()

    produce_events(kafka_bootstrap, topics, _events(reverse_base, "c", seed=11))
    daemons = []
    try:
        a = _start(env, tmp_path, "a", pause="canary.decided")
        daemons.append(a)
        _wait_for(lambda: [r.state for r in the_cycle()] == ["canary"], 300, "daemon a to stage a canary", [a])
        # live traffic on both sides since the canary went live: the canary clearly better
        traffic = []
        for version, prefix, good in (("base", "live-base", 0.2), ("1", "live-canary", 0.8)):
            traffic += served_now(prefix, version, 50, good)
        produce_events(kafka_bootstrap, topics, traffic)
        _wait_for((tmp_path / "a.paused").exists, 120, "daemon a to record the online decision", [a])
        registry = Registry(tracking, MODEL, engine)
        assert registry.alias(CANARY).version == "1" and registry.alias(CHAMPION) is None
        _kill_9(a)

        # more traffic while no daemon runs: a second comparison would count it, the first does not
        produce_events(kafka_bootstrap, topics, served_now("late-canary", "1", 30, 0.8))
        # b's cycle job is an hour away: only its canary job runs (the live traffic above would
        # otherwise be enough new episodes for another cycle)
        b = _start({**env, "RTRL_CYCLE__EVERY": "1h"}, tmp_path, "b")
        daemons.append(b)
        _wait_for(lambda: the_cycle()[0].state == "done", 120, "the cycle to promote the canary", [b])
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    assert b.returncode == 0

    with engine.connect() as conn:
        decisions = conn.execute(
            select(gate_decisions.c.candidate_version, gate_decisions.c.passed, gate_decisions.c.report).order_by(
                gate_decisions.c.id
            )
        ).all()
        moves = conn.execute(select(alias_moves).order_by(alias_moves.c.id)).all()
    # one gate decision and one online decision, both passed: the online one was not made again
    assert [(d.candidate_version, bool(d.passed), d.report.get("stage")) for d in decisions] == [
        ("1", True, None),
        ("1", True, "online"),
    ]
    canary_n = decisions[1].report["sides"]["1"]["n"]
    assert 40 <= canary_n <= 50  # daemon a's comparison: the traffic sent after its death is not in it
    [row] = the_cycle()
    assert row.promoted == 1 and row.candidate_version == "1" and f"(n={canary_n})" in row.reason, row.reason
    registry = Registry(tracking, MODEL, engine)
    assert registry.alias(CHAMPION).version == "1" and registry.alias(CANARY) is None
    # the audit table and the registry agree: staged, promoted, cleared -- each done and published once
    assert [(m.alias, m.to_version, m.status, m.published_at is not None) for m in moves] == [
        ("canary", "1", "done", True),
        ("champion", "1", "done", True),
        ("canary", None, "done", True),
    ]
    assert [(u["alias"], u["version"]) for u in _model_updates(kafka_bootstrap, updates_topic)] == [
        ("canary", "1"),
        ("champion", "1"),
        ("canary", None),
    ]


def test_a_daemon_that_lost_its_lease_mid_training_stops_and_the_cycle_completes_once(
    cfg_env, engine, kafka_bootstrap, topics, reverse_base, tmp_path
):
    """Daemon a is frozen mid-training (SIGSTOP: its heartbeats stop, as in a long GC pause or a
    frozen VM) past the lease's ttl; daemon b takes the lease, resumes the cycle, marks a's run
    failed, trains again, gates and promotes. Then a wakes up, still believing it holds the
    lease: its next training step finds the lease's generation moved on and it stops -- no
    second registration, decision or promotion from it."""
    updates_topic = f"t-{uuid.uuid4().hex[:8]}.model-updates"
    ensure_topics(kafka_bootstrap, [updates_topic], partitions=1)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = _config(tmp_path, reverse_base, tracking, gate="min_ess = 5\nmin_improvement = -1.0")
    env = {**os.environ, **cfg_env, "RTRL_CONFIG": str(config), "RTRL_KAFKA__MODEL_UPDATES_TOPIC": updates_topic}
    produce_events(kafka_bootstrap, topics, _events(reverse_base, "a", seed=8))

    def cycles_now():
        with engine.connect() as conn:
            return conn.execute(select(cycles).where(cycles.c.state != "skipped")).all()

    daemons = []
    try:
        a = _start(env, tmp_path, "a", pause="train.step", pause_s=2.0)
        daemons.append(a)
        _wait_for((tmp_path / "a.paused").exists, 240, "daemon a to reach a training step", [a])
        a.send_signal(signal.SIGSTOP)
        b = _start(env, tmp_path, "b")
        daemons.append(b)
        _wait_for(lambda: cycles_now()[0].state == "done", 300, "daemon b to finish the cycle", [b])
        a.send_signal(signal.SIGCONT)
        _wait_for(
            lambda: "cycle stopped: the lease was lost" in (tmp_path / "a.log").read_text(),
            120,
            "daemon a to notice it lost the lease",
            [a],
        )
    finally:
        for proc in daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
                proc.wait(timeout=60)
    [row] = _stopped_aside(cycles_now())
    assert row.state == "done" and row.promoted == 1 and row.candidate_version == "1", row.reason
    with engine.connect() as conn:
        runs = dict(conn.execute(select(training_runs.c.run_id, training_runs.c.status)).all())
        decisions = conn.execute(select(gate_decisions.c.run_id)).scalars().all()
        moves = conn.execute(select(alias_moves.c.to_version, alias_moves.c.actor)).all()
    assert sorted(runs.values()) == ["failed", "finished"] and runs[row.run_id] == "finished"
    assert decisions == [row.run_id] and [m.to_version for m in moves] == ["1"]
    assert [v.version for v in Registry(tracking, MODEL, engine).list()] == ["1"]
