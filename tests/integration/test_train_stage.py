"""The training stage against the store (SQLite and PostgreSQL) and, end to end, through Kafka:
selection (watermark, staleness, tenant), lineage, the adapter's manifest, counted skips, and
`rtrl train run` producing an MLflow run and an adapter from events ingested from the broker."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta

import pytest
import torch
from click.testing import CliRunner
from sqlalchemy import func, select

from pipeline.cli import cli
from pipeline.core.config import TrainConfig
from pipeline.core.store.events import utcnow, write_rows
from pipeline.core.store.tables import rewards, training_episodes
from pipeline.core.store.training import get_run, is_held_out, lineage, select_eval_episodes
from reward.spec import load_spec
from reward.stage import run_rewards
from tests.support import reverse_task as task
from tests.support.factories import BASE_TS, feedback, interaction
from tests.support.stores import store
from train import lora
from train import run as run_module
from train.models import load_policy
from train.run import NothingToTrain, Parent, TrainJob, run_training
from train.tracking import MemoryTracker

SPEC = load_spec()
LATER = BASE_TS.replace(tzinfo=None) + timedelta(days=1)  # every episode ripe by the window


@pytest.fixture(scope="module")
def samples(reverse_base):
    policy = load_policy(reverse_base, device="cpu")
    prompts, _ = task.split()
    return task.sample_episodes(policy.model, policy.tokenizer, prompts[:24], per_prompt=2, seed=2)


def cfg_for(base, **over) -> TrainConfig:
    return TrainConfig(
        base_model=base, batch_tokens=512, max_seq_len=64, lora_r=4, lora_alpha=8, **{"holdout_percent": 0.0, **over}
    )


def test_run_selects_trains_and_records_lineage_then_continues_from_its_watermark(
    engine, reverse_base, samples, tmp_path
):
    first, second = samples[:30], samples[30:]
    store(engine, *task.as_events(first, "a", BASE_TS, tenants=("acme", "globex")))
    run_rewards(engine, SPEC, now=LATER)
    cfg = cfg_for(reverse_base)

    tracker = MemoryTracker()
    report = run_training(TrainJob(engine, cfg, SPEC.version, tmp_path / "runs", tracker, now=LATER))
    assert report.selection["selected"] == 30 and report.data.episodes == 30
    with engine.connect() as conn:
        newest_reward = conn.scalar(select(func.max(rewards.c.id)))
    assert report.watermark_to == newest_reward

    row = get_run(engine, report.run_id)
    assert row.status == "finished" and row.watermark_to == newest_reward and row.episodes == 30
    assert row.base_revision == load_policy(reverse_base, device="cpu").revision
    assert {r.request_id for r in lineage(engine, report.run_id)} == {f"a-r-{i}" for i in range(30)}
    manifest = json.loads((report.adapter / "rtrl_run.json").read_text())
    assert manifest["watermark"] == newest_reward and manifest["run_id"] == report.run_id
    # one manifest: the training_runs row, the tracker's params and rtrl_run.json cannot disagree
    for key in ("spec_version", "loss", "base_model", "base_revision", "parent_run_id", "watermark_from", "episodes"):
        assert manifest[key] == tracker.params[key] == getattr(row, key), key
    assert (report.adapter / "adapter_model.safetensors").is_file()
    lines = (report.run_dir / "episodes" / "episodes.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["interaction_event_id"] for x in lines) == sorted(f"a-i-{i}" for i in range(30))
    assert tracker.status == "FINISHED" and set(tracker.artifacts) == {"adapter", "episodes"}
    assert tracker.params["spec_version"] == SPEC.version and tracker.params["watermark_to"] == newest_reward
    assert len(tracker.metrics) == report.loop.steps >= 1

    # continuing from that adapter: nothing new yet is a clear refusal, not an empty run
    parent = Parent.from_adapter(report.adapter)
    with pytest.raises(NothingToTrain, match="no rewarded episode selected"):
        run_training(TrainJob(engine, cfg, SPEC.version, tmp_path / "runs", MemoryTracker(), parent, now=LATER))
    store(engine, *task.as_events(second, "b", BASE_TS + timedelta(hours=1)))
    run_rewards(engine, SPEC, now=LATER)
    child = run_training(TrainJob(engine, cfg, SPEC.version, tmp_path / "runs", MemoryTracker(), parent, now=LATER))
    assert child.selection["candidates"] == len(second) == child.data.episodes
    assert get_run(engine, child.run_id).parent_run_id == report.run_id
    # the child's rtrl_run.json names its parent by run, not by a path that was the cycle's to delete
    child_manifest = json.loads((child.adapter / "rtrl_run.json").read_text())
    assert child_manifest["parent_run_id"] == report.run_id and "parent_adapter" not in child_manifest


def test_the_base_stays_loaded_between_runs_and_each_run_starts_from_it_as_loaded(
    engine, reverse_base, samples, tmp_path, monkeypatch
):
    # the daemon trains from the same base every cycle: loaded once per process, and a run's
    # adapter taken off it afterwards -- so a run trains the same adapter either way
    store(engine, *task.as_events(samples[:30], "k", BASE_TS))
    run_rewards(engine, SPEC, now=LATER)
    cfg = cfg_for(reverse_base)
    lora._RESIDENT.clear()
    first = run_training(TrainJob(engine, cfg, SPEC.version, tmp_path / "a", MemoryTracker(), now=LATER))
    resident = lora.resident_base(reverse_base)
    on_disk = load_policy(reverse_base, device="cpu").model.state_dict()
    assert not hasattr(resident.model, "peft_config") and set(resident.model.state_dict()) == set(on_disk)
    assert all(torch.equal(resident.model.state_dict()[k], v) for k, v in on_disk.items())

    loads = []
    monkeypatch.setattr(lora, "load_policy", lambda *a, **k: loads.append(a) or load_policy(*a, **k))
    again = run_training(
        TrainJob(engine, cfg, SPEC.version, tmp_path / "b", MemoryTracker(), now=LATER)
    )  # the same episodes
    assert loads == [] and lora.resident_base(reverse_base) is resident
    assert_same_adapter(first.adapter, again.adapter)

    # keep_base_loaded = false: every run reads the base itself and leaves the resident one alone
    own = []
    monkeypatch.setattr(run_module, "load_policy", lambda *a, **k: own.append(a) or load_policy(*a, **k))
    run_training(
        TrainJob(
            engine,
            cfg_for(reverse_base, keep_base_loaded=False),
            SPEC.version,
            tmp_path / "c",
            MemoryTracker(),
            now=LATER,
        )
    )
    assert len(own) == 1 and loads == [] and lora.resident_base(reverse_base) is resident

    # a run that died with its adapter attached leaves a base that is not reused
    lora.attach_adapter(resident.model, cfg)
    assert lora.resident_base(reverse_base) is not resident and len(loads) == 1


def assert_same_adapter(a, b) -> None:
    from safetensors.torch import load_file

    wa, wb = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert set(wa) == set(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_staleness_tenant_and_limit_are_excluded_and_counted(engine, reverse_base, samples, tmp_path):
    store(engine, *task.as_events(samples[:20], "old", BASE_TS, tenants=("acme", "globex")))
    store(engine, *task.as_events(samples[20:40], "new", BASE_TS + timedelta(days=3), tenants=("acme", "globex")))
    run_rewards(engine, SPEC, now=LATER + timedelta(days=3))
    cfg = cfg_for(reverse_base, staleness_s=2 * 86400, tenant="acme", max_episodes=6)
    report = run_training(
        TrainJob(engine, cfg, SPEC.version, tmp_path, MemoryTracker(), dry_run=True, now=LATER + timedelta(days=3))
    )
    assert report.selection == {
        "candidates": 40,
        "stale": 20,
        "other_tenant": 10,
        "other_policy": 0,
        "held_out": 0,
        "over_limit": 4,
        "selected": 6,
    }
    assert report.run_id is None  # a dry run loads and writes nothing
    with engine.connect() as conn:
        assert conn.scalar(select(func.count()).select_from(training_episodes)) == 0


def test_the_held_out_slice_never_trains_and_is_what_the_gate_evaluates(engine, reverse_base, samples, tmp_path):
    events = task.as_events(samples, "h", BASE_TS)
    store(engine, *events)
    run_rewards(engine, SPEC, now=LATER)
    served = {e["request_id"]: e for e in events if e["type"] == "interaction"}
    held = {rid for rid, e in served.items() if is_held_out(rid, json.dumps(e), 30.0)}
    assert 0 < len(held) < len(samples)
    report = run_training(
        TrainJob(
            engine, cfg_for(reverse_base, holdout_percent=30.0), SPEC.version, tmp_path, MemoryTracker(), now=LATER
        )
    )
    assert report.selection["held_out"] == len(held)
    trained = {r.request_id for r in lineage(engine, report.run_id)}
    assert not held & trained
    evals = select_eval_episodes(engine, SPEC.version, 30.0, limit=len(samples))
    assert {r.request_id for r in evals} == held
    # every prompt is asked twice: none of the held-out ones is trained on in its other request
    # (by request id alone, most were)
    prompts = lambda rids: {json.dumps(served[r]["prompt"]) for r in rids}  # noqa: E731
    assert len(served) == 2 * len(prompts(served)) and not prompts(held) & prompts(trained)
    assert [r.ts for r in evals] == sorted((r.ts for r in evals), reverse=True)  # newest first
    assert len(select_eval_episodes(engine, SPEC.version, 30.0, limit=3)) == 3


def test_bad_episodes_are_counted_skips_not_crashes(engine, reverse_base, samples, tmp_path):
    good = task.as_events(samples[:8], "g", BASE_TS)
    empty = interaction(100, prefix="x", completion="", completion_token_ids=None, behavior_logprobs=None)
    no_assistant = interaction(
        101,
        prefix="x",
        completion=[{"role": "tool", "content": "exit 1"}],
        completion_token_ids=None,
        behavior_logprobs=None,
    )
    misaligned = interaction(
        102, prefix="x", prompt="abc>", completion="cba", completion_token_ids=None, behavior_logprobs=[-0.1]
    )  # three tokens, one log-prob
    fb = [feedback(i, prefix="x", kind="accepted") for i in (100, 101, 102)]
    store(engine, *good + [empty, no_assistant, misaligned] + fb)
    run_rewards(engine, SPEC, now=LATER)
    report = run_training(TrainJob(engine, cfg_for(reverse_base), SPEC.version, tmp_path, MemoryTracker(), now=LATER))
    assert report.data.skipped == {"empty_completion": 1, "no_assistant_tokens": 1}
    assert report.data.behavior.get("misaligned") == 1 and report.data.episodes == 9
    assert {r.request_id for r in lineage(engine, report.run_id)} >= {"x-r-102"}


def store_unchecked(engine, ev: dict, body: str) -> None:
    """`ev` stored with `body` as its text, past the contract: an event stored before the contract
    checked what later stages trust (rows built as ingest builds them)."""
    from pipeline.core.decoded import from_reference
    from pipeline.core.store.events import Rows, event_row
    from pipeline.core.types import InteractionEvent, SourcePosition

    rows = Rows()
    rows.add_event(
        event_row(
            from_reference(InteractionEvent.model_validate(ev)), SourcePosition(source="t", partition=0, offset=0), body
        )
    )
    write_rows(engine, rows)


def test_a_backlog_larger_than_max_episodes_makes_progress_after_a_rejection(engine, reverse_base, samples, tmp_path):
    """30 rewarded episodes waiting, max_episodes 10. A candidate trained on a selection was
    rejected (the champion, and so the watermark, stay): the next selection used to be the same
    oldest 10 -- nothing new, skipped until they aged out -- whatever new traffic arrived."""
    store(engine, *task.as_events(samples[:30], "b", BASE_TS))
    run_rewards(engine, SPEC, now=LATER)
    cfg = cfg_for(reverse_base, max_episodes=10)
    first = run_module.select(engine, cfg, SPEC.version, None, now=LATER)
    assert first.counts["over_limit"] == 20 and len(first.rows) == 10
    # (the rejected candidate trained on `first`); new traffic arrives
    store(engine, *task.as_events(samples[30:35], "c", BASE_TS + timedelta(hours=1)))
    run_rewards(engine, SPEC, now=LATER)
    second = run_module.select(engine, cfg, SPEC.version, None, now=LATER)
    # the cycle trains again only on episodes the rejected run never saw: there are some
    unseen = [r.request_id for r in second.rows if r.reward_id > first.watermark_to]
    assert sorted(unseen) == sorted(f"c-r-{i}" for i in range(5)) and second.watermark_to > first.watermark_to


def test_odd_episodes_are_skipped_and_counted_never_failing_the_run(engine, reverse_base, samples, tmp_path):
    """One odd episode used to fail every cycle that selected it (until it aged out)."""
    store(engine, *task.as_events(samples[:8], "g", BASE_TS))
    plain = dict(prompt="abc>", completion="cba", completion_token_ids=None, behavior_logprobs=None)
    auto = interaction(200, prefix="o", **plain)
    store_unchecked(engine, auto, json.dumps({**auto, "sampling": {"temperature": "auto"}}))
    store(
        engine,
        *[
            interaction(201, prefix="o", **{**plain, "completion_token_ids": [5, 10**6, 7]}),
            interaction(202, prefix="o", **{**plain, "prompt": [{"role": "developer", "content": "abc>"}]}),
        ]
        + [feedback(i, prefix="o", kind="accepted") for i in (200, 201, 202)],
    )
    run_rewards(engine, SPEC, now=LATER)
    # a chat template that refuses a role, as many real ones do
    base = tmp_path / "base"
    shutil.copytree(reverse_base, base)
    (base / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] not in ('system', 'user', 'assistant') %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    )
    report = run_training(TrainJob(engine, cfg_for(base), SPEC.version, tmp_path, MemoryTracker(), now=LATER))
    assert report.data.skipped == {"bad_sampling": 1, "token_ids_out_of_vocabulary": 1, "unrenderable": 1}
    assert report.data.episodes == 8 and get_run(engine, report.run_id).summary["skipped"] == report.data.skipped


def test_rtrl_train_run_from_events_ingested_through_kafka(
    cfg_env, cfg, engine, reverse_base, samples, topics, kafka_bootstrap
):
    from mlflow.tracking import MlflowClient

    from tests.support.kafka_events import ingest_until_caught_up, produce_events

    events = task.as_events(samples, "k", utcnow().replace(tzinfo=BASE_TS.tzinfo) - timedelta(hours=2))
    produce_events(kafka_bootstrap, topics, events)
    assert ingest_until_caught_up(cfg, engine).events == len(events)
    env = {
        **cfg_env,
        "RTRL_TRAIN__BASE_MODEL": str(reverse_base),
        "RTRL_TRAIN__BATCH_TOKENS": "512",
        "RTRL_TRAIN__MAX_SEQ_LEN": "64",
        "RTRL_TRAIN__LORA_R": "4",
    }
    runner = CliRunner()
    assert runner.invoke(cli, ["reward", "run"], env=env).exit_code == 0
    dry = runner.invoke(cli, ["train", "run", "--dry-run"], env=env)
    held = sum(is_held_out(e["request_id"], json.dumps(e), 10.0) for e in events if e["type"] == "interaction")
    assert dry.exit_code == 0 and f"selected: {len(samples) - held}" in dry.output, dry.output

    # in two data-parallel processes (one-process runs: every other training test)
    out = runner.invoke(cli, ["train", "run", "--epochs", "2", "--nproc", "2"], env=env)
    assert out.exit_code == 0, out.output
    run_id = next(line.split()[1] for line in out.output.splitlines() if line.startswith("run "))
    row = get_run(engine, run_id)
    assert row.status == "finished" and row.episodes == len(samples) - held

    client = MlflowClient(tracking_uri=f"sqlite:///{cfg.state_dir / 'mlflow.db'}")
    mlrun = client.get_run(row.tracking_run_id)
    assert mlrun.info.status == "FINISHED" and mlrun.data.params["train.loss"] == "cispo"
    assert mlrun.data.params["spec_version"] == SPEC.version
    assert mlrun.data.params["episodes"] == str(len(samples) - held)
    losses = client.get_metric_history(mlrun.info.run_id, "loss")
    assert [m.step for m in losses] == list(range(1, row.summary["steps"] + 1))
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id, "adapter")}
    assert {"adapter/adapter_model.safetensors", "adapter/rtrl_run.json"} <= artifacts
    assert [a.path for a in client.list_artifacts(mlrun.info.run_id, "episodes")] == ["episodes/episodes.jsonl"]

    shown = runner.invoke(cli, ["train", "show", run_id, "--episodes"], env=env)
    trained = [
        e["request_id"]
        for e in events
        if e["type"] == "interaction" and not is_held_out(e["request_id"], json.dumps(e), 10.0)
    ]
    assert shown.exit_code == 0 and all(f"  {r}\t" in shown.output for r in trained)
    missing = runner.invoke(cli, ["train", "run", "--base-model", "/nonexistent"], env=env)
    assert missing.exit_code != 0 and "/nonexistent" in missing.output


def test_mlflow_tracker_buffers_metrics_and_writes_every_step_by_the_end(tmp_path):
    from mlflow.tracking import MlflowClient

    from deploy.tracking import METRICS_PER_CALL, MlflowTracker

    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(tracking, "buffer", tmp_path / "artifacts")
    steps = METRICS_PER_CALL // 2 + 7  # two metrics a step: one flush on the way, the rest at end()
    for step in range(1, steps + 1):
        tracker.log_metrics({"loss": 1.0 / step, "kl": 0.1}, step=step)
    client = MlflowClient(tracking_uri=tracking)
    assert 0 < len(client.get_metric_history(tracker.run_id, "loss")) < steps  # written on the way, not all yet
    tracker.end("FINISHED")
    assert [m.step for m in client.get_metric_history(tracker.run_id, "loss")] == list(range(1, steps + 1))
    assert len(client.get_metric_history(tracker.run_id, "kl")) == steps


def test_a_run_uses_the_configured_cpu_threads(engine, reverse_base, samples, tmp_path):
    # train.cpu_threads: for a daemon that shares the cores with serving
    store(engine, *task.as_events(samples[:20], "t", BASE_TS))
    run_rewards(engine, SPEC, now=LATER)
    before = torch.get_num_threads()
    try:
        run_training(
            TrainJob(
                engine,
                cfg_for(reverse_base, cpu_threads=before + 1),
                SPEC.version,
                tmp_path / "a",
                MemoryTracker(),
                now=LATER,
            )
        )
        assert torch.get_num_threads() == before + 1
    finally:
        torch.set_num_threads(before)
