"""Alias moves against a real MLflow registry (an embedded SQLite tracking store) and the store
on SQLite and PostgreSQL, without training: versions are registered from empty runs and given
a recorded passing decision. What is checked is what an operator and serving rely on:

- a late model-update event never undoes a newer state (repair sends only the newest move of
  an alias; a canary's withdrawal whose event could not be sent does not break repair);
- a failed promotion keeps the rollback target; rollbacks walk back through the promotions;
  a rolled-back version is not promoted again automatically, nor is a candidate decided
  against a champion an operator has replaced meanwhile.
"""

from __future__ import annotations

import uuid

import pytest
from mlflow.tracking import MlflowClient

from deploy.registry import CANARY, CHAMPION, PREVIOUS, Registry, RegistryError, Superseded
from pipeline.core.store import deploys as audit
from pipeline.core.store.deploys import moves

pytestmark = pytest.mark.usefixtures("engine")


class Broker:
    """What the registry publishes through: records events, or fails while `away`."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.away = False

    def __call__(self, event: dict) -> None:
        if self.away:
            raise ConnectionError("broker unreachable")
        self.events.append(event)


@pytest.fixture
def setup(engine, tmp_path):
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    name = f"policy-{uuid.uuid4().hex[:6]}"
    broker = Broker()
    registry = Registry(tracking, name, engine, broker)
    client = MlflowClient(tracking_uri=tracking)
    experiment = client.create_experiment(f"e-{uuid.uuid4().hex[:6]}")

    def version(champion: str | None = None) -> str:
        run = client.create_run(experiment)
        v = registry.register(run.info.run_id, {"base_model": "base"}).version
        audit.record_decision(engine, name, v, champion, None, True, {"decision": {"passed": True, "checks": []}})
        return v

    return registry, broker, version


def test_repair_after_the_broker_was_away_sends_only_the_newest_move(setup, engine):
    registry, broker, version = setup
    v1, v2 = version(), version()
    broker.away = True
    registry.promote(v1, "automatic", "gate passed")
    registry.promote(v2, "automatic", "gate passed")
    assert broker.events == []
    broker.away = False
    repaired = registry.repair()
    # only v2 is announced: v1's event, sent after v2's move, would switch serving back to v1
    assert [(e["alias"], e["version"]) for e in broker.events] == [(CHAMPION, v2)], repaired
    assert any("superseded" in line for line in repaired)
    assert broker.events[0]["seq"] == moves(engine, registry.name)[0].id
    assert registry.repair() == []  # nothing left unpublished


def test_a_canary_withdrawn_while_the_broker_is_away_does_not_break_repair(setup):
    registry, broker, version = setup
    v1, v2 = version(), version()
    registry.promote(v1, "automatic", "gate passed")
    registry.stage(v2, 0.5, "automatic", "gate passed")
    broker.away = True
    registry.unstage("automatic", "rejected online")  # the event of a withdrawal (no target) fails to send
    assert registry.alias(CANARY) is None
    broker.away = False
    registry.repair()  # raised AttributeError on target.version: every cycle failed while the broker was away
    assert [(e["alias"], e["version"]) for e in broker.events][-1] == (CANARY, None)


def test_a_failed_promotion_keeps_the_rollback_target(setup, monkeypatch):
    registry, broker, version = setup
    v1, v2, v3 = version(), version(), version()
    registry.promote(v1, "automatic", "gate passed")
    registry.promote(v2, "automatic", "gate passed")
    real = registry.client.set_registered_model_alias

    def champion_fails(name, alias, v):
        if alias == CHAMPION:
            raise ConnectionError("registry went away")
        return real(name, alias, v)

    monkeypatch.setattr(registry.client, "set_registered_model_alias", champion_fails)
    with pytest.raises(RegistryError):
        registry.promote(v3, "automatic", "gate passed")
    monkeypatch.undo()
    assert (registry.alias(CHAMPION).version, registry.alias(PREVIOUS).version) == (v2, v1)
    assert registry.rollback("bob", "v2 is worse").version == v1


def test_rollbacks_walk_back_and_a_rolled_back_version_is_not_promoted_again(setup):
    registry, broker, version = setup
    v1, v2, v3 = version(), version(), version()
    for v in (v1, v2, v3):
        registry.promote(v, "automatic", "gate passed")
    assert registry.rollback("bob", "v3 reverts edits").version == v2
    assert registry.alias(PREVIOUS).version == v1
    assert registry.rollback("bob", "v2 too").version == v1  # not back to v3
    assert registry.alias(PREVIOUS) is None
    with pytest.raises(RegistryError, match="no `previous`"):
        registry.rollback("bob", "again")
    with pytest.raises(Superseded, match="rolled back by bob"):
        registry.promote(v3, "automatic", "cycle resumed in promoting")
    assert registry.alias(CHAMPION).version == v1
    assert registry.promote(v3, "alice", "fixed upstream", force=True)  # a person may
    assert registry.alias(PREVIOUS).version == v1


def test_a_decision_against_a_replaced_champion_does_not_promote(setup):
    registry, broker, version = setup
    v1, v2 = version(), version()
    registry.promote(v1, "automatic", "gate passed")
    v3 = version(champion=v1)
    registry.promote(v2, "alice", "hotfix", force=True)
    with pytest.raises(Superseded, match="decided against champion 1"):
        registry.promote(v3, "automatic", "cycle", against=v1)
    assert registry.alias(CHAMPION).version == v2


def test_a_cycle_resumed_in_promoting_does_not_promote_a_rolled_back_version(setup, engine, tmp_path):
    from pipeline.core.config import load_config
    from pipeline.core.store.cycles import create_cycle, set_cycle
    from pipeline.cycle import CycleDeps, run_cycle
    from reward.spec import load_spec

    registry, broker, version = setup
    v1, v2 = version(), version()
    registry.promote(v1, "automatic", "gate passed")
    # a cycle promoted v2 and died before recording it; an operator rolled v2 back meanwhile
    create_cycle(engine, "c-resumed")
    set_cycle(engine, "c-resumed", state="promoting", candidate_version=v2)
    registry.promote(v2, "automatic", "cycle c-resumed: gate passed")
    registry.rollback("bob", "v2 reverts edits")
    deps = CycleDeps(
        engine,
        load_config(environ={"RTRL_STATE_DIR": str(tmp_path)}),
        load_spec(),
        registry,
        make_tracker=None,
        make_runner=None,
    )
    row = run_cycle(deps)
    assert row.state == "rejected" and "rolled back by bob" in row.reason, row.reason
    assert registry.alias(CHAMPION).version == v1


def test_a_rollback_to_a_version_that_was_never_the_champion_needs_its_gate_or_force(setup, engine):
    """`rtrl rollback --to V` shipped a version whose gate failed without --force (promote refuses
    the same version): a rollback to a version that never served is a promotion."""
    registry, broker, version = setup
    v1, v2 = version(), version()
    failed = version()
    audit.record_decision(
        engine,
        registry.name,
        failed,
        v2,
        None,
        False,
        {"decision": {"passed": False, "checks": [], "reasons": ["kl too high"]}},
    )
    for v in (v1, v2):
        registry.promote(v, "automatic", "gate passed")
    with pytest.raises(RegistryError, match=f"never the champion.*failed its gate.*rollback --to {failed} --force"):
        registry.rollback("bob", "try it", to=failed)
    assert registry.alias(CHAMPION).version == v2
    assert registry.rollback("bob", "v2 reverts edits", to=v1).version == v1  # a former champion: restored
    with pytest.raises(RegistryError, match="--force needs --reason"):
        registry.rollback("bob", "", to=failed, force=True)
    assert registry.rollback("bob", "the gate's KL check misfires on this one", to=failed, force=True).version == failed
