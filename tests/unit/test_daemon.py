"""The daemon's schedules: a bad schedule is refused, and a scheduled cycle that finds the last
one still running is counted, not overlapped."""

from __future__ import annotations

import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from pipeline.core.config import ConfigError, load_config
from pipeline.daemon import Daemon, trigger
from tests.support.helpers import wait_for


def test_schedules_and_a_bad_schedule_is_refused():
    assert trigger("90s").interval == timedelta(seconds=90)
    assert trigger("4h").interval == timedelta(hours=4)
    assert "hour='*/4'" in repr(trigger("0 */4 * * *"))
    with pytest.raises(ConfigError, match="cycle.every"):
        load_config(environ={"RTRL_CYCLE__EVERY": "every tuesday"})
    with pytest.raises(ConfigError, match="rollout.max_wait"):
        load_config(environ={"RTRL_ROLLOUT__MAX_WAIT": "a while"})
    with pytest.raises(ConfigError, match="rollout.share"):
        load_config(environ={"RTRL_ROLLOUT__SHARE": "1.5"})


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_scheduled_cycle_that_finds_the_last_one_running_is_counted_not_overlapped(engine, monkeypatch):
    # a cycle that outlasts `cycle.every` (the naive demo's long trainings): the next scheduled
    # run does not start (max_instances=1), and says so in a metric
    config = load_config(environ={"RTRL_CYCLE__EVERY": "1s"})
    daemon = Daemon(config, SimpleNamespace(engine=engine, owner=None), lease_ttl_s=30)
    running, release_cycle = [], threading.Event()
    monkeypatch.setattr(daemon, "cycle", lambda only_canary=False: running.append(1) or release_cycle.wait(60))
    daemon.start(ingest=False)
    try:

        def not_started() -> float:
            return (
                daemon.metrics.registry.get_sample_value(
                    "rtrl_cycle_runs_not_started_total", {"reason": "still_running"}
                )
                or 0.0
            )

        wait_for(lambda: not_started() >= 2, 30, "two scheduled runs to find the cycle still running")
        assert len(running) == 1  # never two at once
    finally:
        release_cycle.set()
        daemon.shutdown()


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_run_dispatched_as_shutdown_begins_neither_takes_the_lease_again_nor_hangs(engine):
    """A scheduled run the scheduler had already handed to its thread when shutdown began took
    the lease again (its heartbeat) and then waited forever on the lock shutdown keeps: the
    lease stayed held past the process, and the thread held up the exit."""
    from pipeline.core.store.leases import acquire
    from pipeline.daemon import LEASE

    config = load_config(environ={"RTRL_CYCLE__EVERY": "1h"})
    daemon = Daemon(config, SimpleNamespace(engine=engine, owner=None), lease_ttl_s=30)
    daemon.start(ingest=False)
    assert daemon.holds_lease
    daemon.shutdown(drain_s=5)
    late = threading.Thread(target=daemon.cycle)
    late.start()
    late.join(timeout=10)
    assert not late.is_alive(), "a run after shutdown waits on the cycle lock"
    daemon.heartbeat()  # the lease job's last tick
    assert not daemon.holds_lease
    assert acquire(engine, LEASE, "next-daemon", 30) is not None  # free for the next daemon at once


def _record(state: str, reason: str | None = None):
    from datetime import UTC, datetime

    from pipeline.core.store.cycles import CycleRecord

    now = datetime.now(UTC)
    return CycleRecord("c-1", state, reason, None, None, None, {}, None, now, now, None)


@pytest.mark.parametrize(
    ("returns", "outcome", "code"),
    [
        ("rejected", "rejected", 0),  # the loop working: a CronJob must not retry it
        ("skipped", "skipped", 0),
        ("canary", "canary", 0),  # waiting on traffic: the next run looks again
        ("failed", "failed", 1),
        (RuntimeError("store away"), "unrecorded", 3),
    ],
)
@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_once_runs_one_cycle_exits_with_what_happened_and_frees_the_lease(engine, monkeypatch, returns, outcome, code):
    from pipeline.core.store.leases import acquire
    from pipeline.daemon import LEASE
    from pipeline.once import run_once

    def cycle(deps):
        assert deps.fence is not None and deps.fence.owner == daemon.owner  # run under the lease
        if isinstance(returns, Exception):
            raise returns
        return _record(returns, reason="a reason")

    monkeypatch.setattr("pipeline.daemon.run_cycle", cycle)
    daemon = Daemon(load_config(), SimpleNamespace(engine=engine, owner=None), lease_ttl_s=30)
    result = run_once(daemon, ingest=False)
    assert (result.outcome, result.exit_code) == (outcome, code)
    assert acquire(engine, LEASE, "next-daemon", 30) is not None  # released: the next run goes on at once


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_once_runs_nothing_while_another_daemon_holds_the_lease(engine, monkeypatch):
    from pipeline.core.store.leases import acquire, holder
    from pipeline.daemon import LEASE
    from pipeline.once import run_once

    ran = []
    monkeypatch.setattr("pipeline.daemon.run_cycle", lambda deps: ran.append(deps))
    assert acquire(engine, LEASE, "the-daemon", 30) is not None
    result = run_once(Daemon(load_config(), SimpleNamespace(engine=engine, owner=None), lease_ttl_s=30), ingest=False)
    assert (result.outcome, result.exit_code, ran) == ("lease_held", 4, [])
    assert holder(engine, LEASE).owner == "the-daemon"  # not released by a run that never held it


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_once_renews_the_lease_while_its_cycle_runs(engine, monkeypatch):
    # a cycle longer than the lease's ttl: without renewal another daemon would take it over mid-cycle
    from pipeline.core.store.leases import acquire, holder
    from pipeline.daemon import LEASE
    from pipeline.once import run_once

    def cycle(deps):
        first = holder(engine, LEASE)
        wait_for(lambda: holder(engine, LEASE).expires_at > first.expires_at, 20, "the lease to be renewed")
        assert acquire(engine, LEASE, "another-daemon", 3) is None
        return _record("done")

    monkeypatch.setattr("pipeline.daemon.run_cycle", cycle)
    result = run_once(Daemon(load_config(), SimpleNamespace(engine=engine, owner=None), lease_ttl_s=3), ingest=False)
    assert (result.outcome, result.exit_code) == ("done", 0)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_once_stopped_by_a_signal_says_so(engine, monkeypatch):
    from pipeline.once import run_once

    daemon = Daemon(load_config(), SimpleNamespace(engine=engine, owner=None), lease_ttl_s=30)

    def cycle(deps):
        daemon.stop.set()  # SIGTERM mid-cycle: run_cycle stops before its next stage, returns None
        return None

    monkeypatch.setattr("pipeline.daemon.run_cycle", cycle)
    result = run_once(daemon, ingest=False)
    assert (result.outcome, result.exit_code) == ("stopped", 6)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_a_cycle_finished_by_its_canary_check_counts_its_whole_life_in_the_duration_metric(engine, monkeypatch):
    """A cycle that staged a canary returns before it is decided; the short canary check that
    finishes it later must observe the cycle's whole life (started .. finished), not its own
    seconds, which made three 30-40 s cycles read 3.6 s."""
    from pipeline.once import run_once

    row = replace(_record("done"), started_at=datetime.now(UTC) - timedelta(seconds=40), finished_at=datetime.now(UTC))
    monkeypatch.setattr("pipeline.daemon.run_cycle", lambda deps: row)
    daemon = Daemon(load_config(), SimpleNamespace(engine=engine, owner=None), lease_ttl_s=30)
    assert run_once(daemon, ingest=False).exit_code == 0
    observed = daemon.metrics.registry.get_sample_value("rtrl_cycle_duration_seconds_sum")
    assert observed is not None and observed >= 40


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_the_champion_gauge_follows_a_rollback_made_between_cycles(engine, monkeypatch):
    """`rtrl rollback` moves the alias from the CLI; the daemon's gauge must follow within its
    refresh interval, not keep the old version until the next cycle."""
    aliases = {"champion": SimpleNamespace(version="2")}
    registry = SimpleNamespace(alias=lambda name: aliases.get(name))
    monkeypatch.setattr("pipeline.daemon.POLICY_METRICS_EVERY_S", 0.2)
    config = load_config(environ={"RTRL_CYCLE__EVERY": "1h"})
    daemon = Daemon(config, SimpleNamespace(engine=engine, owner=None, registry=registry), lease_ttl_s=30)
    daemon.start(ingest=False)
    try:
        champion = lambda: daemon.metrics.registry.get_sample_value("rtrl_champion_version")  # noqa: E731
        wait_for(lambda: champion() == 2.0, 30, "the gauge to show the champion")
        aliases["champion"] = SimpleNamespace(version="1")  # rolled back from the CLI
        wait_for(lambda: champion() == 1.0, 30, "the gauge to follow the rollback")
    finally:
        daemon.shutdown()
