"""Staged rollout: a candidate that passed the gate serves a share of live traffic as the canary,
and the online comparison promotes it or withdraws it (the real broker, SQLite, the local MLflow
store, a tiny model)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from deploy import stage as deploy_stage
from deploy.registry import CANARY, CHAMPION
from pipeline.core.config import RolloutConfig
from pipeline.core.store.cycles import get_cycle, recent_cycles, set_cycle, unfinished_cycle
from pipeline.core.store.deploys import latest_decision, moves
from pipeline.core.store.tables import training_runs
from pipeline.cycle import run_cycle
from pipeline.daemon import Daemon
from reward.spec import load_spec
from tests.support.cycle import LEASE_TTL_S, cycle_deps, feed
from tests.support.factories import served_now
from tests.support.helpers import REPO, wait_for
from tests.support.kafka_events import ingest_until_caught_up, produce_events

# the cycle runs on SQLite and the local MLflow store here, as in test_cycle
on_sqlite = pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)


def online_traffic(cfg, engine, topics, kafka_bootstrap, prefix: str, version: str, n: int, good: float) -> None:
    """served_now(...) through the broker into the store."""
    produce_events(kafka_bootstrap, topics, served_now(prefix, version, n, good))
    ingest_until_caught_up(cfg, engine)


@pytest.fixture
def deps(cfg, engine, reverse_base, tmp_path):
    published = []
    d = cycle_deps(cfg, engine, reverse_base, tmp_path, publish=published.append)
    # the default spec with outcomes final 1 s after the interaction: only requests whose
    # ripeness window has passed enter the online comparison
    spec = (REPO / "reward" / "default_spec.toml").read_text().replace("window_s = 3600", "window_s = 1")
    (tmp_path / "spec.toml").write_text(spec)
    d.spec = load_spec(tmp_path / "spec.toml")
    d.config.rollout = RolloutConfig(
        share=0.5, min_requests=40, margin=0.05, confidence=0.9, max_wait="1h", covariate="prompt"
    )
    d.config.gate.min_ess = 2  # these tests are about what happens after the gate passed
    d.config.gate.min_improvement = -1.0
    d.published = published
    return d


def _staged(deps, cfg, engine, topics, kafka_bootstrap, reverse_base, prefix: str, seed: int):
    feed(cfg, engine, topics, kafka_bootstrap, reverse_base, prefix, seed=seed)
    row = run_cycle(deps)
    assert row.state == "canary", row.reason  # the gate passed; live traffic decides
    version = row.candidate_version
    assert deps.registry.alias(CANARY).version == version and deps.registry.alias(CHAMPION) is None
    assert deps.published[-1]["alias"] == "canary" and deps.published[-1]["share"] == 0.5
    assert moves(engine, "cycle-policy")[0].share == 0.5
    again = run_cycle(deps)  # no traffic yet: still measuring, and nothing trained meanwhile
    assert again.cycle_id == row.cycle_id and again.state == "canary"
    with engine.connect() as conn:
        assert len(conn.execute(training_runs.select()).all()) == 1
    return row, version


@on_sqlite
def test_a_canary_better_online_is_promoted_and_stops_being_a_canary(
    deps, cfg, engine, topics, kafka_bootstrap, reverse_base
):
    row, version = _staged(deps, cfg, engine, topics, kafka_bootstrap, reverse_base, "p", seed=11)
    online_traffic(cfg, engine, topics, kafka_bootstrap, "p-base", "base", 60, good=0.2)
    online_traffic(cfg, engine, topics, kafka_bootstrap, "p-canary", version, 60, good=0.8)
    # the daemon's canary job (every rollout.check_every) resumes the waiting cycle; a check
    # with nothing waiting does not start a cycle
    daemon = Daemon(deps.config, deps, lease_ttl_s=LEASE_TTL_S)
    with daemon.cycle_running:  # a cycle is running: the canary job does not queue behind it
        daemon.check_canary()
    assert get_cycle(engine, row.cycle_id).state == "canary"
    wait_for(
        lambda: daemon.check_canary() or daemon.last_cycle["state"] == "done",
        60,
        "the canary's requests to settle and the comparison to promote it",
        interval=0.5,
    )
    daemon.check_canary()
    assert unfinished_cycle(engine) is None and len(recent_cycles(engine)) == 1
    metrics = generate_latest(daemon.metrics.registry).decode()
    assert f"rtrl_champion_version {float(version)}" in metrics, metrics
    assert 'rtrl_policy_served{alias="champion"}' in metrics and 'alias="canary"' not in metrics, metrics
    done = get_cycle(engine, row.cycle_id)
    assert done.state == "done" and done.promoted == 1, done.reason
    assert "online reward: canary" in done.reason and "promotion boundary" in done.reason
    assert {"stage", "online", "promote"} <= set(done.timings)
    assert deps.registry.alias(CHAMPION).version == version and deps.registry.alias(CANARY) is None
    decision = latest_decision(engine, "cycle-policy", version)
    assert decision.passed and decision.report["stage"] == "online" and decision.report["sides"][version]["n"] == 60
    assert decision.report["sides"]["sequential"]["verdict"] == "promote"
    # serving hears the champion move, then the canary cleared
    assert [(e["alias"], e["version"]) for e in deps.published[-2:]] == [("champion", version), ("canary", None)]
    assert deps.registry.get(version).tags["online.passed"] == "true"


@on_sqlite
def test_a_canary_worse_online_is_withdrawn_and_the_champion_stays(
    deps, cfg, engine, topics, kafka_bootstrap, reverse_base
):
    row, version = _staged(deps, cfg, engine, topics, kafka_bootstrap, reverse_base, "w", seed=12)
    online_traffic(cfg, engine, topics, kafka_bootstrap, "w-base", "base", 60, good=0.6)
    online_traffic(cfg, engine, topics, kafka_bootstrap, "w-canary", version, 30, good=0.2)
    waiting = run_cycle(deps)  # 30 of the 40 canary requests the first look needs
    assert waiting.state == "canary" and "the first look needs 40 a side" in waiting.reason, waiting.reason
    online_traffic(cfg, engine, topics, kafka_bootstrap, "w-canary2", version, 30, good=0.2)
    rejected = wait_for(lambda: (r := run_cycle(deps)).state != "canary" and r, 60, "the comparison", interval=0.5)
    assert rejected.state == "rejected" and rejected.promoted == 0 and "futility boundary" in rejected.reason
    assert deps.registry.alias(CANARY) is None and deps.registry.alias(CHAMPION) is None
    assert deps.published[-1] == {**deps.published[-1], "alias": "canary", "version": None, "share": 0.0}
    assert not latest_decision(engine, "cycle-policy", version).passed
    # a human cannot promote it without overriding the online decision
    with pytest.raises(Exception, match="failed its gate"):
        deps.registry.promote(version, actor="op", reason="")


@on_sqlite
def test_a_canary_without_traffic_is_withdrawn_after_max_wait(deps, cfg, engine, topics, kafka_bootstrap, reverse_base):
    row, version = _staged(deps, cfg, engine, topics, kafka_bootstrap, reverse_base, "t", seed=13)
    deps.config.rollout.max_wait = "0.001s"
    rejected = run_cycle(deps)
    assert rejected.state == "rejected" and "within rollout.max_wait" in rejected.reason
    assert deps.registry.alias(CANARY) is None


@on_sqlite
def test_a_failing_canary_check_is_retried_and_a_canary_left_by_a_failed_cycle_is_withdrawn(
    deps, cfg, engine, topics, kafka_bootstrap, reverse_base, monkeypatch
):
    row, version = _staged(deps, cfg, engine, topics, kafka_bootstrap, reverse_base, "f", seed=14)

    def store_away(*a, **k):
        raise ConnectionError("the store went away")

    with monkeypatch.context() as m:  # the check fails: the canary keeps serving, the cycle waits
        m.setattr(deploy_stage, "online_units", store_away)
        again = run_cycle(deps)
    assert again.state == "canary" and "last check failed: ConnectionError" in again.reason
    assert deps.registry.alias(CANARY).version == version
    # a cycle that ended without withdrawing its canary (here: marked failed by hand): the next
    # cycle withdraws it first, so no canary serves without a cycle measuring it
    set_cycle(engine, row.cycle_id, state="failed", reason="promotion failed")
    run_cycle(deps)
    withdrawn = [m for m in moves(engine, "cycle-policy") if m.alias == CANARY and m.to_version is None]
    assert withdrawn and withdrawn[-1].from_version == version and "no cycle is measuring" in withdrawn[-1].reason


@on_sqlite
def test_a_champion_moved_by_an_operator_during_the_canary_is_not_overridden(
    deps, cfg, engine, topics, kafka_bootstrap, reverse_base
):
    """An operator puts another version in (a rollback, a hotfix) while the canary is out: the
    canary was gated against the champion of then, and the cycle promoted it over the operator's
    choice once its online comparison -- against the new champion -- passed."""
    row, version = _staged(deps, cfg, engine, topics, kafka_bootstrap, reverse_base, "o", seed=14)
    hotfix = deps.registry.register(deps.registry.get(version).run_id, {"base_model": "base"}).version
    deps.registry.promote(hotfix, actor="alice", reason="hotfix while the canary runs", force=True)
    online_traffic(cfg, engine, topics, kafka_bootstrap, "o-champion", hotfix, 60, good=0.2)
    online_traffic(cfg, engine, topics, kafka_bootstrap, "o-canary", version, 60, good=0.8)
    rejected = wait_for(lambda: (r := run_cycle(deps)).state != "canary" and r, 60, "the canary's check", interval=0.5)
    assert rejected.state == "rejected" and "the champion moved" in rejected.reason, rejected.reason
    assert deps.registry.alias(CHAMPION).version == hotfix and deps.registry.alias(CANARY) is None
