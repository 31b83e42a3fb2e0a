"""Outages: the registry, the store or the broker going away in the middle of a cycle fails the
cycle cleanly -- recorded where the store can take it -- and never the daemon; the next run
retries it. The daemon's ingest outlives the store going away too, and loses nothing.

    registry   a real `mlflow server`, killed as the gate starts: the cycle ends `failed` with
               the reason; restarted on the same stores, the next cycle trains again on the
               same episodes (the failed one was never judged) and promotes
    store      PostgreSQL refusing connections to the store's database as the gate starts:
               nothing can be recorded, the daemon's job returns; once it is back, the next run
               resumes the cycle from `evaluating` and finishes it, once
    broker     nothing listening at the broker address when the champion moves: the cycle is
               done, the model-update event waits in the audit trail; the next cycle, with the
               broker there, publishes it first thing (even one that then has nothing to do)
    ingest     the store refusing connections while events keep arriving: ingest stops, is
               restarted by the daemon until the store is back, and then stores every event
               once (it re-reads from the offsets stored with the rows)
"""

from __future__ import annotations

import json
import os
import time

import pytest
from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import create_engine, select, text

from deploy.registry import CHAMPION
from deploy.serving.events import ModelUpdatePublisher
from pipeline import cycle as cycle_mod
from pipeline.core.store.cycles import recent_cycles
from pipeline.core.store.deploys import moves
from pipeline.core.store.event_reads import stored_offsets
from pipeline.core.store.online import served_and_accepted
from pipeline.core.store.tables import feedback as feedback_table
from pipeline.core.store.tables import interactions, training_runs
from pipeline.core.store.training import get_run
from pipeline.daemon import Daemon
from pipeline.kafka_local import ensure_topics
from tests.support import mlflow_server
from tests.support.cycle import LEASE_TTL_S, cycle_deps, feed
from tests.support.factories import feedback, interaction
from tests.support.helpers import free_port, wait_for
from tests.support.kafka_events import count, produce_events


def _cycles_by_outcome(daemon: Daemon, outcome: str) -> float:
    return daemon.metrics.registry.get_sample_value("rtrl_cycles_total", {"outcome": outcome}) or 0.0


def _gate_after(monkeypatch, outage) -> None:
    """The next gate starts right after `outage()`: mid-cycle, the candidate trained."""
    real_gate = cycle_mod.gate_run

    def gate(*args, **kwargs):
        outage()
        return real_gate(*args, **kwargs)

    monkeypatch.setattr(cycle_mod, "gate_run", gate)


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_the_registry_going_away_fails_the_cycle_and_the_next_one_retries_it(
    cfg, engine, topics, kafka_bootstrap, reverse_base, tmp_path, monkeypatch
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")  # unreachable is unreachable: no waiting
    port = free_port()
    server = mlflow_server.start(tmp_path / "mlflow", port)
    try:
        deps = cycle_deps(cfg, engine, reverse_base, tmp_path, tracking=f"http://127.0.0.1:{port}")
        daemon = Daemon(deps.config, deps, lease_ttl_s=LEASE_TTL_S)
        assert feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "g", seed=11) > 0
        with monkeypatch.context() as m:
            _gate_after(m, lambda: mlflow_server.kill(server))
            daemon.cycle()  # returns: the daemon outlives the registry
        failed = recent_cycles(engine, 1)[0]
        assert failed.state == "failed" and "unreachable" in failed.reason, failed.reason
        assert get_run(engine, failed.run_id).status == "finished"  # trained, never judged
        assert daemon.health()["last_cycle"]["state"] == "failed"
        assert _cycles_by_outcome(daemon, "failed") == 1

        server = mlflow_server.start(tmp_path / "mlflow", port)  # back, on the same stores
        daemon.cycle()
        done = recent_cycles(engine, 1)[0]
        assert done.state == "done" and done.promoted == 1, done.reason
        # trained again on the episodes the failed cycle had (nothing new arrived): it was not skipped
        assert done.run_id != failed.run_id
        assert get_run(engine, done.run_id).watermark_to == get_run(engine, failed.run_id).watermark_to
        assert [v.version for v in deps.registry.list()] == [done.candidate_version] == ["1"]
        assert deps.registry.alias(CHAMPION).version == "1"
        assert [(m.to_version, m.status) for m in moves(engine, "cycle-policy")] == [("1", "done")]
        assert _cycles_by_outcome(daemon, "done") == 1
        # the online check on the promotion, from the store (no previous: the first promotion)
        served, accepted = served_and_accepted(engine, ["1"])["1"]
        sample = daemon.metrics.registry.get_sample_value
        assert sample("rtrl_policy_served", {"alias": "champion"}) == served > 0
        assert sample("rtrl_policy_accept_rate", {"alias": "champion"}) == pytest.approx(accepted / served)
        assert sample("rtrl_policy_served", {"alias": "previous"}) is None
    finally:
        mlflow_server.stop(server)


class PostgresOutage:
    """The store's PostgreSQL database refusing new connections, its open ones cut; then back."""

    def __init__(self, engine) -> None:
        self.admin = create_engine(os.environ["RTRL_TEST_POSTGRES"], isolation_level="AUTOCOMMIT")
        self.database = engine.url.database

    def away(self) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS false'))
            conn.execute(
                text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"), {"d": self.database}
            )

    def back(self) -> None:
        with self.admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{self.database}" ALLOW_CONNECTIONS true'))
        self.admin.dispose()


@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_the_store_going_away_leaves_the_cycle_to_resume_once_it_is_back(
    cfg, engine, topics, kafka_bootstrap, reverse_base, tmp_path, monkeypatch
):
    deps = cycle_deps(cfg, engine, reverse_base, tmp_path)
    daemon = Daemon(deps.config, deps, lease_ttl_s=LEASE_TTL_S)
    assert feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "p", seed=12) > 0
    outage = PostgresOutage(engine)
    try:
        with monkeypatch.context() as m:
            _gate_after(m, outage.away)
            daemon.cycle()  # returns: the daemon outlives the store
        assert daemon.health()["last_cycle"]["state"] == "unrecorded"
        assert _cycles_by_outcome(daemon, "unrecorded") == 1
    finally:
        outage.back()
    interrupted = recent_cycles(engine, 1)[0]
    assert interrupted.state == "evaluating", interrupted.reason  # the last state it could record

    daemon.cycle()  # the store is back: the same cycle resumes from evaluating
    [done] = recent_cycles(engine, 10)
    assert done.cycle_id == interrupted.cycle_id and done.run_id == interrupted.run_id
    assert done.state == "done" and done.promoted == 1, done.reason
    with engine.connect() as conn:
        assert conn.execute(select(training_runs.c.status)).scalars().all() == ["finished"]  # trained once
    assert [v.version for v in deps.registry.list()] == ["1"]
    assert [(m.to_version, m.status) for m in moves(engine, "cycle-policy")] == [("1", "done")]


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_the_broker_away_at_promotion_leaves_the_event_for_the_next_cycle(
    cfg, engine, topics, kafka_bootstrap, reverse_base, tmp_path
):
    updates = topics["interactions"].replace(".interactions", ".model-updates")
    nowhere = ModelUpdatePublisher(f"127.0.0.1:{free_port()}", updates)
    nowhere.timeout_s = 2.0
    deps = cycle_deps(cfg, engine, reverse_base, tmp_path, publish=nowhere)
    assert feed(cfg, engine, topics, kafka_bootstrap, reverse_base, "k", seed=13) > 0
    first = cycle_mod.run_cycle(deps)
    assert first.state == "done" and first.promoted == 1, first.reason  # the champion moved
    [move] = moves(engine, "cycle-policy")
    assert (move.to_version, move.status, move.published_at) == ("1", "done", None)  # the event waits

    ensure_topics(kafka_bootstrap, [updates], 1)
    deps.registry.publish = ModelUpdatePublisher(kafka_bootstrap, updates)  # the broker is there
    second = cycle_mod.run_cycle(deps)  # nothing new to train on: skipped, but it starts by repairing
    assert second.state == "skipped", second.reason
    [move] = moves(engine, "cycle-policy")
    assert move.published_at is not None
    consumer = KafkaConsumer(
        updates,
        bootstrap_servers=kafka_bootstrap,
        auto_offset_reset="earliest",
        group_id=None,
        consumer_timeout_ms=1000,
    )
    seen, deadline = [], time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        seen += [json.loads(r.value) for r in consumer]
    consumer.close()
    assert [(e["version"], e["alias"]) for e in seen] == [("1", CHAMPION)]


@pytest.mark.parametrize("empty_db_url", ["postgresql"], indirect=True)
def test_ingest_outlives_the_store_going_away_and_stores_every_event_once(
    cfg, engine, topics, kafka_bootstrap, reverse_base, tmp_path
):
    deps = cycle_deps(cfg, engine, reverse_base, tmp_path)
    deps.config.cycle.every = "1h"  # ingest only: no cycle in this test
    daemon = Daemon(deps.config, deps, lease_ttl_s=LEASE_TTL_S)

    def events(start: int, n: int) -> list[dict]:
        return [e for i in range(start, start + n) for e in (interaction(i, prefix="o"), feedback(i, prefix="o"))]

    daemon.start(ingest=True, metrics_port=None)
    outage = PostgresOutage(engine)
    try:
        produce_events(kafka_bootstrap, topics, events(0, 50))
        wait_for(
            lambda: count(engine, interactions) == 50 and count(engine, feedback_table) == 50,
            60,
            "the first 50 requests stored",
        )
        outage.away()
        try:
            produce_events(kafka_bootstrap, topics, events(50, 100))  # arriving while the store is away
            errors = lambda: daemon.metrics.registry.get_sample_value("rtrl_ingest_errors_total")  # noqa: E731
            wait_for(lambda: errors() >= 1, 60, "ingest to fail on the store and be restarted")
        finally:
            outage.back()
        wait_for(
            lambda: count(engine, interactions) >= 150 and count(engine, feedback_table) >= 150,
            90,
            "every event stored once the store is back",
        )
        with engine.connect() as conn:
            stored = conn.execute(select(interactions.c.event_id)).scalars().all()
        assert sorted(stored) == sorted(f"o-i-{i}" for i in range(150))  # none lost, none twice
        assert count(engine, feedback_table) == 150
    finally:
        daemon.shutdown()
    # shutdown waited for ingest to drain: what it stored is committed to Kafka too
    offsets = stored_offsets(engine, deps.config.ingest.group_id)
    assert sum(offsets.values()) == 300
    check = KafkaConsumer(
        bootstrap_servers=kafka_bootstrap, group_id=deps.config.ingest.group_id, enable_auto_commit=False
    )
    committed = {tp: check.committed(TopicPartition(*tp)) for tp in offsets}
    check.close()
    assert committed == offsets
