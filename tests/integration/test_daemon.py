"""The daemon: the cycle lease (both stores), two `rtrl daemon` processes against one store
(exactly one runs cycles; kill -9 it and the other takes over within the lease's ttl), the
metrics and health endpoints, and a daemon refused at start."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import requests
from sqlalchemy import select

from pipeline.core.store.leases import acquire, holder, release
from pipeline.core.store.tables import cycles
from tests.support.helpers import REPO, free_port, wait_for


def test_the_lease_is_held_by_one_owner_until_it_expires_or_is_released(engine):
    assert acquire(engine, "cycle", "a", ttl_s=60)
    assert not acquire(engine, "cycle", "b", ttl_s=60)
    assert acquire(engine, "cycle", "a", ttl_s=0.2)  # renewing, with a short ttl
    # b takes over once a's lease expired
    wait_for(lambda: acquire(engine, "cycle", "b", ttl_s=60), 10, "a's lease to expire", interval=0.05)
    assert holder(engine, "cycle").owner == "b" and not acquire(engine, "cycle", "a", ttl_s=60)
    release(engine, "cycle", "b")
    assert acquire(engine, "cycle", "a", ttl_s=60)


def test_the_lease_generation_fences_writes_of_a_holder_that_was_taken_over(engine, monkeypatch):
    from pipeline.core.store import events
    from pipeline.core.store.cycles import create_cycle, get_cycle, set_cycle
    from pipeline.core.store.leases import Fence, LeaseLost

    first = acquire(engine, "cycle", "a", ttl_s=0.2)
    assert acquire(engine, "cycle", "a", ttl_s=0.2) == first  # renewing keeps the generation
    fence_a = Fence("cycle", "a", first)
    create_cycle(engine, "c-1", "a", fence=fence_a)
    set_cycle(engine, "c-1", fence=fence_a, state="training")
    # a is paused past its ttl; b takes over: a new generation
    second = wait_for(lambda: acquire(engine, "cycle", "b", ttl_s=60), 10, "a's lease to expire", interval=0.05)
    assert second == first + 1
    with pytest.raises(LeaseLost, match="no longer held by a"):
        set_cycle(engine, "c-1", fence=fence_a, state="evaluating")  # a wakes up and writes
    assert get_cycle(engine, "c-1").state == "training"
    set_cycle(engine, "c-1", fence=Fence("cycle", "b", second), state="evaluating")
    # the database's clock decides, not a host's: a host an hour ahead cannot take b's live lease
    ahead = events.utcnow() + timedelta(hours=1)
    monkeypatch.setattr(events, "utcnow", lambda: ahead)
    assert acquire(engine, "cycle", "c", ttl_s=60) is None and holder(engine, "cycle").owner == "b"


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_daemon_with_a_missing_base_model_is_refused_at_start(cfg_env, engine, tmp_path):
    env = {
        **os.environ,
        **cfg_env,
        "RTRL_TRAIN__BASE_MODEL": str(tmp_path / "no-model"),
        "RTRL_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
    }
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "daemon", "--metrics-port", str(free_port())],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert f"train.base_model: cannot load the model at {tmp_path / 'no-model'}" in out.stderr, out.stderr


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # the lease: both stores, above
def test_two_daemons_one_runs_cycles_and_the_other_takes_over(cfg_env, engine, tmp_path):
    env = {
        **cfg_env,
        "RTRL_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "RTRL_CYCLE__EVERY": "1s",
        "RTRL_CYCLE__MIN_NEW_EPISODES": "1000000",
    }  # cycles skip quickly

    def start(name: str) -> tuple[subprocess.Popen, int]:
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "daemon", "--metrics-port", str(port), "--lease-ttl", "3"],
            env={**os.environ, **env},
            cwd=REPO,
            stdout=open(tmp_path / f"{name}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        return proc, port

    def owners() -> list[str]:
        with engine.connect() as conn:
            return [r.owner for r in conn.execute(select(cycles.c.owner).order_by(cycles.c.started_at))]

    host = socket.gethostname()
    a, a_port = start("a")
    b = None
    try:
        wait_for(lambda: len(owners()) >= 1, 120, "daemon a's first cycle")
        b, b_port = start("b")
        wait_for(
            lambda: requests.get(f"http://127.0.0.1:{b_port}/health", timeout=2).ok if _listening(b_port) else False,
            120,
            "daemon b to start",
        )
        seen = len(owners())
        wait_for(lambda: len(owners()) >= seen + 3, 60, "more cycles")
        assert set(owners()) == {f"{host}:{a.pid}"}  # b ingests, but never runs a cycle
        assert json.loads(requests.get(f"http://127.0.0.1:{b_port}/health").text)["lease"] is False

        a.send_signal(signal.SIGKILL)
        a.wait()
        killed_at = time.monotonic()
        wait_for(lambda: f"{host}:{b.pid}" in owners(), 30, "daemon b to take over")
        assert time.monotonic() - killed_at < 3 + 10  # the lease's ttl, plus a heartbeat and a cycle period
        # b's cycle row is written when the cycle starts; its counter when it ends
        skipped = 'rtrl_cycles_total{outcome="skipped"}'
        wait_for(
            lambda: skipped in requests.get(f"http://127.0.0.1:{b_port}/metrics").text, 30, "b's first cycle to finish"
        )
        metrics = requests.get(f"http://127.0.0.1:{b_port}/metrics").text
        for name in (
            "rtrl_ingest_events",
            "rtrl_ingest_rate",
            "rtrl_dead_letters",
            "rtrl_consumer_lag",
            "rtrl_ingest_errors_total",
            "rtrl_cycle_duration_seconds",
            "rtrl_cycles_total",
            "rtrl_champion_version",
            "rtrl_reward_mean",
            "rtrl_gate_decisions",
            "rtrl_lease_held 1.0",
            'rtrl_cycle_part_seconds{part="reward"}',
            "rtrl_cycle_outside_loop_ratio",
            "rtrl_cycle_runs_not_started_total",
        ):
            assert name in metrics, name
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    assert b.returncode == 0  # SIGTERM: a clean exit


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_once_ingests_runs_one_cycle_and_exits_with_what_happened(cfg_env, engine, kafka_bootstrap, topics, tmp_path):
    """`rtrl daemon --once` as a CronJob runs it: what the topics hold is stored first, one cycle
    runs (skipped here: too few rewarded episodes), exit 0; while a daemon holds the lease, exit 4."""
    from pipeline.core.store.tables import interactions
    from tests.support.factories import interaction
    from tests.support.kafka_events import produce_events

    produce_events(kafka_bootstrap, topics, [interaction(i, prefix="once") for i in range(5)])
    env = {
        **os.environ,
        **cfg_env,
        "RTRL_MLFLOW__TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "RTRL_CYCLE__MIN_NEW_EPISODES": "1000000",
    }

    def once() -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "daemon", "--once"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=180,
        )

    out = once()
    assert out.returncode == 0, out.stderr[-3000:]
    assert "skipped" in out.stdout and "5 events ingested first" in out.stdout, out.stdout
    with engine.connect() as conn:
        assert len(conn.execute(select(interactions.c.id)).all()) == 5
        assert [r.state for r in conn.execute(select(cycles.c.state))] == ["skipped"]
    assert acquire(engine, "cycle", "a-daemon", ttl_s=120) is not None  # the run released it
    held = once()
    assert held.returncode == 4 and "lease_held" in held.stdout, held.stdout + held.stderr[-2000:]
    with engine.connect() as conn:
        assert len(conn.execute(select(cycles.c.state)).all()) == 1  # no second cycle
