"""Gate, registry and audit end to end, with real training runs on the reverse task:

    SQLite store    + embedded MLflow (SQLite tracking store)
    PostgreSQL store + a real `mlflow server` process (HTTP tracking + registry)

v1 (learned to reverse) passes the first-deployment gate and is promoted automatically; v2 (trained
on a reward that abstentions game) is rejected by the canaries, refused by `promote`, forced in by a
named operator with a reason, rolled back; every move is audited and announced on Kafka; a crash
between the registry call and the audit write is repaired; bad input is a clear error.
"""

from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta

import pytest
from kafka import KafkaConsumer

from deploy import registry as registry_mod
from deploy.registry import CANARY, CHAMPION, PREVIOUS, Registry, RegistryError
from deploy.serving.events import ModelUpdatePublisher
from deploy.stage import GateJob, adapter_name, gate_run
from deploy.suite import load_suite
from deploy.tracking import MlflowTracker
from pipeline.core.config import Bound, GateConfig, TrainConfig
from pipeline.core.store.deploys import moves
from pipeline.kafka_local import ensure_topics
from reward.spec import load_spec
from reward.stage import run_rewards
from tests.support import mlflow_server as mlflow_server_proc
from tests.support import reverse_task as task
from tests.support.factories import BASE_TS, feedback, interaction
from tests.support.helpers import free_port
from tests.support.stores import store
from train.inference import PolicySet
from train.models import load_policy
from train.run import Parent, TrainJob, run_training

SPEC = load_spec()
NOW = BASE_TS.replace(tzinfo=None) + timedelta(days=2)
ABSTAIN = (r"^\s*\?+\s*$",)  # the deployment's canary: a bare "???" is an abstention
GATE = GateConfig(
    eval_episodes=400,
    generate_prompts=40,
    max_new_tokens=3,
    min_ess=5,
    max_kl=5.0,  # one update of a tiny model moves it far from its base (the first gate's baseline)
    bounds={"smoke_latency_ms": Bound(max_rel_increase=50.0)},
)  # tiny models: latency is noise
TRAIN = dict(
    learning_rate=5e-3,
    epochs=8,
    batch_tokens=1024,
    max_seq_len=64,
    lora_r=8,
    lora_alpha=16,
    holdout_percent=30.0,
    staleness_s=None,
)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` (tracking + registry + artifact proxy) on 127.0.0.1."""
    port = free_port()
    proc = mlflow_server_proc.start(tmp_path_factory.mktemp("mlflow-server"), port)
    yield f"http://127.0.0.1:{port}"
    mlflow_server_proc.stop(proc)


def reverse_episodes(policy, prefix: str, seed: int) -> list[dict]:
    prompts, _ = task.split()
    return task.sample_episodes(policy.model, policy.tokenizer, prompts, per_prompt=2, seed=seed)


def gaming_events(episodes: list[dict], prefix: str) -> list[dict]:
    """Logged traffic where "???" drew no complaint and real attempts were often rejected:
    a reward spec blind to that abstention pays for it."""
    events = []
    start = BASE_TS + timedelta(hours=5)
    for i, e in enumerate(episodes):
        ts = (start + timedelta(seconds=i)).isoformat().replace("+00:00", "Z")
        abstain = i % 2 == 0
        events.append(
            interaction(
                i,
                prefix=prefix,
                ts=ts,
                prompt=e["prompt"],
                policy_version="1",
                completion="???" if abstain else e["completion"],
                sampling={"temperature": 1.0},
                completion_token_ids=None if abstain else e["completion_token_ids"],
                behavior_logprobs=None if abstain else e["behavior_logprobs"],
            )
        )
        events.append(feedback(i, prefix=prefix, kind="accepted" if abstain else "rejected", value=True, ts=ts))
    return events


def model_updates(bootstrap: str, topic: str, n: int) -> list[dict]:
    consumer = KafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None, consumer_timeout_ms=1000
    )
    out, deadline = [], time.monotonic() + 30
    while len(out) < n and time.monotonic() < deadline:
        out += [json.loads(r.value) for r in consumer]
    consumer.close()
    return out


def test_gate_promote_reject_force_rollback_and_repair(
    engine, reverse_base, tmp_path, mlflow_server, kafka_bootstrap, monkeypatch
):
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}" if engine.dialect.name == "sqlite" else mlflow_server
    topic = f"t-{uuid.uuid4().hex[:8]}.model-updates"
    ensure_topics(kafka_bootstrap, [topic], partitions=1)
    name = f"policy-{uuid.uuid4().hex[:6]}"
    publisher = ModelUpdatePublisher(kafka_bootstrap, topic)
    registry = Registry(tracking, name, engine, publisher, cache_dir=tmp_path / "adapter-cache")
    suite_file = tmp_path / "suite.toml"
    suite_file.write_text(
        'name = "format"\n'
        + "".join(
            f'[[items]]\nid = "{s}"\nprompt = "{s}>"\ncheck = "regex"\npattern = "^[a-f]{{3}}$"\n'
            for s in ("abc", "fed")
        )
    )
    suite = load_suite(suite_file)
    base = load_policy(reverse_base, device="cpu")

    def train(parent=None, **over):
        tracker = MlflowTracker(tracking, "rtrl-test", tmp_path / "artifacts")
        cfg = TrainConfig(base_model=reverse_base, **{**TRAIN, **over})
        return run_training(TrainJob(engine, cfg, SPEC.version, tmp_path / "runs", tracker, parent, now=NOW))

    runner = PolicySet.load(reverse_base, device="cpu")  # one for every gate, as the daemon keeps it

    def gate(run, promote=True):
        return gate_run(
            GateJob(
                engine,
                registry,
                runner,
                run.run_id,
                SPEC.version,
                TrainConfig(base_model=reverse_base, **TRAIN),
                GATE,
                suite=suite,
                abstention_patterns=ABSTAIN,
                promote=promote,
            )
        )

    # v1: learned to reverse from logged, rewarded samples of the base policy
    store(engine, *task.as_events(reverse_episodes(base, "a", seed=3), "a", BASE_TS))
    run_rewards(engine, SPEC, now=NOW)
    first = gate(train())
    assert first.decision.first_deployment and first.decision.passed, first.decision.reasons
    assert first.promoted and registry.alias(CHAMPION).version == first.version.version == "1"
    assert first.evaluation.comparison.improvement.low > 0  # vs the base model, on the held-out slice
    assert registry.get("1").tags["gate.passed"] == "true"
    assert runner.names == {adapter_name(first.version)}  # the new champion stays loaded

    # v2: trained (from v1) on traffic where abstaining paid -- the canaries reject it
    store(engine, *gaming_events(reverse_episodes(base, "g", seed=4), "g"))
    run_rewards(engine, SPEC, now=NOW)
    v1_adapter = tmp_path / "runs" / first.version.tags["rtrl.run_id"] / "adapter"
    # (no importance truncation or masking: the "???" completions are far off the champion's
    # distribution, which would rightly stop the update; the point here is a candidate that did
    # learn the hack)
    second = gate(train(Parent.from_adapter(v1_adapter), sequence_mask=None, token_truncate=None))
    failing = {c.name for c in second.decision.checks if not c.passed}
    assert not second.decision.passed and "bound:abstention_rate" in failing, second.decision.reasons
    assert second.evaluation.candidate.metrics["abstention_rate"] > 0.3 and not second.promoted
    assert registry.alias(CHAMPION).version == "1"
    # the rejected candidate is unloaded; the champion was never loaded again (nor downloaded)
    assert runner.names == {adapter_name(first.version)} and not (tmp_path / "adapter-cache").exists()
    downloads = []
    monkeypatch.setattr(
        registry, "download", lambda v, dst, real=registry.download: downloads.append(v) or real(v, dst)
    )
    cached = registry.adapter(registry.get("1"), tmp_path)  # a version's adapter is downloaded once
    assert registry.adapter(registry.get("1"), tmp_path) == cached and len(downloads) == 1
    assert (cached / "adapter_config.json").is_file() and Parent.from_adapter(cached).run_id == first.version.tags[
        "rtrl.run_id"
    ]
    monkeypatch.undo()
    with pytest.raises(RegistryError, match="failed its gate"):
        registry.promote("2", actor="alice", reason="")
    with pytest.raises(RegistryError, match="--reason"):
        registry.promote("2", actor="alice", reason=" ", force=True)

    # a human overrides, then rolls back; promoting the champion again is a no-op
    assert registry.promote("2", actor="alice", reason="hotfix for tenant acme", force=True)
    assert (registry.alias(CHAMPION).version, registry.alias(PREVIOUS).version) == ("2", "1")
    assert registry.rollback(actor="bob", reason="abstains too often").version == "1"
    # v1 replaced no champion: nothing further back to go to (never back to v2)
    assert registry.alias(CHAMPION).version == "1" and registry.alias(PREVIOUS) is None
    assert registry.promote("1", actor="bob", reason="again") is False
    trail = [(m.from_version, m.to_version, m.actor, m.status) for m in reversed(moves(engine, name))]
    assert trail == [(None, "1", "automatic", "done"), ("1", "2", "alice", "done"), ("2", "1", "bob", "done")]
    events = model_updates(kafka_bootstrap, topic, 3)
    assert [(e["name"], e["version"], e["alias"]) for e in events] == [
        (name, "1", CHAMPION),
        (name, "2", CHAMPION),
        (name, "1", CHAMPION),
    ]
    assert all(e["adapter_uri"].endswith("/adapter") and e["base_model"] == str(reverse_base) for e in events)

    # a crash between the alias move and the audit write: the next start repairs it
    real = registry_mod.audit.complete_move

    def crash(*a, **k):
        raise KeyboardInterrupt("killed")

    registry_mod.audit.complete_move = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            registry.promote("2", actor="carol", reason="retry", force=True)
    finally:
        registry_mod.audit.complete_move = real
    assert registry.alias(CHAMPION).version == "2" and moves(engine, name)[0].status == "pending"
    repaired = Registry(tracking, name, engine, publisher).repair()
    assert any("completed" in line for line in repaired) and moves(engine, name)[0].status == "done"
    assert model_updates(kafka_bootstrap, topic, 4)[-1]["version"] == "2"

    # a canary (staged rollout): staged, then a crash while it is being cleared; repair sees the
    # alias gone, completes the move and tells serving
    assert registry.stage("1", 0.25, actor="carol", reason="canary") and registry.alias(CANARY).version == "1"
    registry_mod.audit.complete_move = crash
    try:
        with pytest.raises(KeyboardInterrupt):
            registry.unstage(actor="carol", reason="withdrawn")
    finally:
        registry_mod.audit.complete_move = real
    assert registry.alias(CANARY) is None and moves(engine, name)[0].status == "pending"
    repaired = Registry(tracking, name, engine, publisher).repair()
    assert any("(canary: 1 -> None): completed" in line for line in repaired), repaired
    events = model_updates(kafka_bootstrap, topic, 6)[-2:]
    assert [(e["alias"], e["version"], e["share"]) for e in events] == [(CANARY, "1", 0.25), (CANARY, None, 0.0)]
    publisher.close()

    # bad input: a version that does not exist, a registry that is not there
    with pytest.raises(RegistryError, match="no version 99"):
        registry.promote("99", actor="bob", reason="x", force=True)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    down = Registry(f"http://127.0.0.1:{free_port()}", name, engine)
    recorded = len(moves(engine, name))
    with pytest.raises(RegistryError, match="unreachable|failed"):
        down.promote("1", actor="bob", reason="x", force=True)
    assert len(moves(engine, name)) == recorded  # nothing was recorded as moved


# the registry is under test here; the PostgreSQL store is covered above
@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_cli_from_kafka_to_train_gate_promote_rollback_on_an_mlflow_server(
    cfg_env, cfg, engine, reverse_base, topics, kafka_bootstrap, mlflow_server
):
    from click.testing import CliRunner

    from pipeline.cli import cli
    from pipeline.core.store.events import utcnow
    from tests.support.kafka_events import ingest_until_caught_up, produce_events

    base = load_policy(reverse_base, device="cpu")
    events = task.as_events(
        reverse_episodes(base, "k", seed=5), "k", utcnow().replace(tzinfo=BASE_TS.tzinfo) - timedelta(hours=2)
    )
    produce_events(kafka_bootstrap, topics, events)
    assert ingest_until_caught_up(cfg, engine).events == len(events)
    updates = f"t-{uuid.uuid4().hex[:8]}.model-updates"
    ensure_topics(kafka_bootstrap, [updates], partitions=1)
    env = {
        **cfg_env,
        "RTRL_TRAIN__BASE_MODEL": str(reverse_base),
        "RTRL_TRAIN__LEARNING_RATE": "5e-3",
        "RTRL_TRAIN__EPOCHS": "8",
        "RTRL_TRAIN__BATCH_TOKENS": "1024",
        "RTRL_TRAIN__MAX_SEQ_LEN": "64",
        "RTRL_TRAIN__LORA_R": "8",
        "RTRL_TRAIN__LORA_ALPHA": "16",
        "RTRL_TRAIN__HOLDOUT_PERCENT": "30",
        "RTRL_MLFLOW__TRACKING_URI": mlflow_server,
        "RTRL_MLFLOW__REGISTERED_MODEL": f"cli-{uuid.uuid4().hex[:6]}",
        "RTRL_KAFKA__MODEL_UPDATES_TOPIC": updates,
        "RTRL_GATE__MAX_NEW_TOKENS": "3",
        "RTRL_GATE__MIN_ESS": "5",
        "RTRL_GATE__MAX_KL": "5",
        "RTRL_GATE__MIN_IMPROVEMENT": "-1",  # the commands are under test here, not the bound (see test_cycle)
        "RTRL_GATE__GENERATE_PROMPTS": "40",
        "USER": "ops-alice",
    }
    runner = CliRunner()

    def rtrl(*args, ok=True):
        out = runner.invoke(cli, list(args), env=env)
        assert (out.exit_code == 0) == ok, out.output
        return out.output

    rtrl("reward", "run")
    rtrl("train", "run")
    gated = rtrl("gate", "--promote")
    failing = [line for line in gated.splitlines() if "FAIL" in line]
    assert "PASSED" in gated and "promoted v1 to champion" in gated and "first deployment" in gated, failing
    # which estimator decided, and why the outcome model was (not) used: here too few episodes to fit one
    assert "improvement by importance" in gated and "outcome model: not used: is missing: too few" in gated, gated
    assert "already" in rtrl("promote", "1")
    assert "no `previous` version" in rtrl("rollback", ok=False)

    rtrl("train", "run", "--since", "0")  # a second candidate from the same data
    # a bar no candidate clears: the decision is FAILED, stored, and the exit code says so (CI branches on it)
    refused = runner.invoke(cli, ["gate"], env={**env, "RTRL_GATE__MIN_IMPROVEMENT": "100"})
    second = refused.output
    assert refused.exit_code == 3 and "FAILED" in second, second
    assert "candidate v2" in second and "against champion v1" in second
    assert "failed its gate" in rtrl("promote", "2", ok=False)
    assert "v2 is the champion" in rtrl("promote", "2", "--force", "--reason", "canary tenant")
    assert "v1 is the champion" in rtrl("rollback", "--reason", "back to the gated one")
    assert "no canary to withdraw" in rtrl("rollback", "--canary")
    listed = rtrl("models", "list")
    assert "v1" in listed and "champion" in listed.split("v1", 1)[1].splitlines()[0] and "gate: " in listed
    shown = rtrl("models", "show", "2")
    assert "gate decision" in shown and "by ops-alice" in shown and "canary tenant" in shown
    assert "no version 7" in rtrl("promote", "7", ok=False)
    assert [e["version"] for e in model_updates(kafka_bootstrap, updates, 3)] == ["1", "2", "1"]


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # store-independent
def test_a_candidate_whose_adapter_does_not_load_fails_the_smoke_check(engine, reverse_base, tmp_path):
    from pipeline.core.store.training import finish_run, start_run

    bad = tmp_path / "adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"peft_type": "LORA", "r": ')  # truncated
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(tracking, "rtrl-test", tmp_path / "artifacts")
    tracker.log_artifacts(bad, "adapter")
    start_run(
        engine,
        run_id="r-bad",
        tracking_run_id=tracker.run_id,
        spec_version=SPEC.version,
        loss="cispo",
        base_model=str(reverse_base),
        base_revision="x",
        watermark_from=0,
        watermark_to=0,
        episodes=0,
    )
    finish_run(engine, "r-bad", "finished", adapter_path=str(bad))
    registry = Registry(tracking, f"policy-{uuid.uuid4().hex[:6]}", engine)
    result = gate_run(
        GateJob(
            engine,
            registry,
            PolicySet.load(reverse_base, device="cpu"),
            "r-bad",
            SPEC.version,
            TrainConfig(),
            GATE,
            promote=True,
        )
    )
    assert not result.decision.passed and not result.promoted
    assert any("cannot load the adapter" in r for r in result.decision.reasons), result.decision.reasons
    assert registry.alias(CHAMPION) is None and registry.get("1").tags["gate.passed"] == "false"


@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)  # store-independent
def test_a_crash_between_registering_and_deciding_does_not_register_the_run_twice(engine, reverse_base, tmp_path):
    from pipeline.core.store.training import finish_run, start_run

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(tracking, "rtrl-test", tmp_path / "artifacts")
    bad = tmp_path / "adapter"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{")  # fails the smoke check quickly: the point is the registry
    tracker.log_artifacts(bad, "adapter")
    start_run(
        engine,
        run_id="r-1",
        tracking_run_id=tracker.run_id,
        spec_version=SPEC.version,
        loss="cispo",
        base_model=str(reverse_base),
        base_revision="x",
        watermark_from=0,
        watermark_to=0,
        episodes=0,
    )
    finish_run(engine, "r-1", "finished", adapter_path=str(bad))
    registry = Registry(tracking, f"policy-{uuid.uuid4().hex[:6]}", engine)
    runner = PolicySet.load(reverse_base, device="cpu")
    real = registry.record_decision

    def crash(*a, **k):
        raise KeyboardInterrupt("killed")

    registry.record_decision = crash
    with pytest.raises(KeyboardInterrupt):
        gate_run(GateJob(engine, registry, runner, "r-1", SPEC.version, TrainConfig(), GATE))
    registry.record_decision = real
    result = gate_run(GateJob(engine, registry, runner, "r-1", SPEC.version, TrainConfig(), GATE))  # the resumed cycle
    assert result.version.version == "1" and [v.version for v in registry.list()] == ["1"]


def test_odd_held_out_episodes_are_left_out_and_counted_not_failing_the_gate(reverse_base, tmp_path):
    """A held-out prompt the chat template refuses used to fail both policies' smoke check, and
    served token ids outside the vocabulary the log-prob comparison, for as long as it stayed in
    the window."""
    import shutil

    from deploy.evaluate import EvalJob, evaluate
    from pipeline.core.types import LoggedEpisode
    from tests.support.adapters import make_adapter

    base = tmp_path / "base"
    shutil.copytree(reverse_base, base)
    (base / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    runner = PolicySet.load(base, device="cpu")
    runner.add("cand", make_adapter(base, tmp_path / "adapter", seed=3))
    prompts, _ = task.split()
    good = [LoggedEpisode(f"g{i}", f"{p}>", p[::-1], None, [-1.0] * 3, 1.0, 1.0) for i, p in enumerate(prompts[:20])]
    odd = [
        LoggedEpisode("role", [{"role": "developer", "content": "abc>"}], "cba", None, [-1.0] * 3, 1.0, 1.0),
        LoggedEpisode("vocab", "abc>", "cba", [5, 10**6, 7], [-1.0] * 3, 1.0, 1.0),
    ]
    evaluation = evaluate(EvalJob(runner, "cand", None, good + odd, GATE, generate_prompts=40, max_new_tokens=3))
    assert evaluation.candidate.smoke_ok and evaluation.champion.smoke_ok
    assert evaluation.excluded["unrenderable_prompts"] == 1 and evaluation.excluded["misaligned"] == 1
    assert evaluation.episodes == 20
