"""The training stage: select rewarded episodes, train a LoRA update, record everything.

    select     rewards of the spec created after the parent's watermark, served within the
               staleness budget, optionally one tenant (train/selection.py)
    load       the base model; the parent's adapter (the champion's) trainable, else a fresh one
    tokenize   assistant-only loss masks, behaviour log-probs aligned or dropped (train/selection.py)
    train      train/loop.py
    record     one RunManifest (run id, data watermark, base model and revision, parent), written
               as the training_runs row, the tracker's params and <run>/adapter/rtrl_run.json;
               <run>/episodes.jsonl (the exact episodes and rewards), the lineage rows, the
               tracker's per-step metrics and artifacts

One call, one job: run_training(TrainJob(...)), built by the cycle or `rtrl train run`.

An adapter directory carries its own data watermark in rtrl_run.json: continuing from it reads
only rewards the parent never saw.
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import orjson
import torch
from sqlalchemy import Engine

from pipeline.core.config import TrainConfig
from pipeline.core.store.training import Selection, finish_run, record_lineage, start_run
from pipeline.core.timing import Stopwatch
from train.data import DataStats, TokenizedEpisode
from train.distributed import run_distributed
from train.loop import LoopResult, train_policy
from train.lora import attach_adapter, load_adapter, release, resident_base, save_adapter, set_gradient_checkpointing
from train.models import ModelError, load_policy, set_cpu_threads
from train.selection import select, tokenize_selection
from train.tracking import Tracker

RUN_MANIFEST = "rtrl_run.json"


class NothingToTrain(RuntimeError):
    """No usable episode: the message says what was excluded and what to do."""


@dataclass
class Parent:
    adapter: Path
    run_id: str | None
    watermark: int

    @classmethod
    def from_adapter(cls, path: str | Path) -> Parent:
        path = Path(path)
        if not (path / "adapter_config.json").is_file():
            raise ModelError(f"no adapter at {path}: expected adapter_config.json and adapter_model.safetensors")
        try:
            manifest = json.loads((path / RUN_MANIFEST).read_text())
        except FileNotFoundError:  # an adapter made outside rtrl: it has seen none of our data
            return cls(path, None, 0)
        except json.JSONDecodeError as exc:
            raise ModelError(f"corrupt {path / RUN_MANIFEST}: {exc}") from None
        return cls(path, manifest.get("run_id"), int(manifest.get("watermark", 0)))


@dataclass
class TrainReport:
    run_id: str | None
    selection: dict[str, int]
    watermark_from: int
    watermark_to: int
    data: DataStats = field(default_factory=DataStats)
    too_long: int = 0
    unreadable: int = 0
    by_policy_version: dict[str, int] = field(default_factory=dict)
    loop: LoopResult | None = None
    adapter: Path | None = None
    run_dir: Path | None = None


def _nothing(report: TrainReport, why: str) -> NothingToTrain:
    c = report.selection
    return NothingToTrain(
        f"nothing to train: {why} ({c['candidates']} rewards after watermark {report.watermark_from}; "
        f"{c['stale']} stale, {c['other_tenant']} of other tenants, {c.get('other_policy', 0)} served by another "
        f"model, {c['held_out']} held out for evaluation, "
        f"{report.data.skipped or 'no'} skipped, "
        f"{report.too_long} too long). Ingest more events and run `rtrl reward run`, or widen "
        "train.staleness_s / drop train.tenant."
    )


@dataclass(frozen=True)
class TrainJob:
    """One training run (run_training), as the cycle or `rtrl train run` builds it."""

    engine: Engine
    cfg: TrainConfig
    spec_version: str  # whose rewards it learns from
    runs_dir: Path  # <runs_dir>/<run_id>/ holds the adapter, the episodes, checkpoints
    tracker: Tracker  # its params, per-step metrics and artifacts (MLflow, or in memory)
    parent: Parent | None = None  # the adapter it continues (the champion's); None: a fresh one
    since: int | None = None  # read rewards after this id instead of the parent's watermark
    now: datetime | None = None  # the staleness budget's "now" (tests pin it)
    params: dict[str, Any] = field(default_factory=dict)  # more tracker params (the cycle's id)
    on_step: Callable[[int, int, dict[str, float]], None] | None = None  # (step, total, metrics)
    run_id: str | None = None  # recorded by the caller before the run starts (a cycle that may crash)
    selection: Selection | None = None  # one the caller made with select() already (and counted)
    dry_run: bool = False  # only the selection: nothing loaded, nothing written


@dataclass(frozen=True)
class RunManifest:
    """What a run is, made once: the training_runs row, the tracker's params and the adapter's
    rtrl_run.json are each written from it, so that they cannot disagree."""

    run_id: str
    spec_version: str
    loss: str
    base_model: str
    base_revision: str
    parent_run_id: str | None
    parent_adapter: str | None
    watermark_from: int  # the rewards it read: ids in (watermark_from, watermark_to]
    watermark_to: int
    episodes: int
    device: str

    def row(self) -> dict[str, Any]:
        """The training_runs row's columns."""
        return {k: v for k, v in asdict(self).items() if k not in ("parent_adapter", "device")}

    def adapter_file(self) -> dict[str, Any]:
        """rtrl_run.json, beside the adapter's weights; `watermark` is what Parent.from_adapter reads.
        Without where the parent was read from (a cycle's temporary copy, gone once the run ends:
        parent_run_id names it) and the device: neither is the adapter's, wherever it is copied."""
        kept = {k: v for k, v in asdict(self).items() if k not in ("parent_adapter", "device")}
        return {**kept, "watermark": self.watermark_to}


def run_training(job: TrainJob) -> TrainReport:
    """One training run (the module's steps); with `job.dry_run`, only the selection."""
    engine, cfg, spec_version, tracker, parent = job.engine, job.cfg, job.spec_version, job.tracker, job.parent
    selection = job.selection or select(engine, cfg, spec_version, parent, job.now, job.since)
    report = TrainReport(
        run_id=None,
        selection=selection.counts,
        watermark_from=selection.watermark_from,
        watermark_to=selection.watermark_to,
        by_policy_version=dict(Counter(r.policy_version for r in selection.rows)),
    )
    if job.dry_run:
        return report
    if not selection.rows:
        raise _nothing(report, "no rewarded episode selected")
    if cfg.base_model is None:
        raise ModelError(
            "train.base_model is not set: point it at a local model directory "
            "(RTRL_TRAIN__BASE_MODEL=/path, or `rtrl train run --base-model /path`)"
        )
    watch = Stopwatch()  # where the run's seconds went, kept in its summary
    set_cpu_threads(cfg.cpu_threads)
    with watch("load"):
        # kept loaded: read from disk by this process's first run only
        policy = (
            resident_base(cfg.base_model, cfg.torch_device)
            if cfg.keep_base_loaded
            else load_policy(cfg.base_model, device=cfg.torch_device)
        )
    with watch("tokenize"):
        episodes, rows, groups = tokenize_selection(policy.tokenizer, selection, cfg, report)
    if not episodes:
        raise _nothing(report, "every selected episode was skipped")
    report.watermark_to = selection.watermark_to  # skipped episodes are read too: never selected again
    # seeded here, not before the load: a fresh adapter's initialisation (and the steps after it)
    # must not depend on whether this process had the base loaded already
    torch.manual_seed(cfg.seed)
    with watch("load"):
        model = load_adapter(policy.model, parent.adapter) if parent else attach_adapter(policy.model, cfg)
    set_gradient_checkpointing(model, cfg.gradient_checkpointing)

    run_id = report.run_id = job.run_id or uuid.uuid4().hex
    run_dir = report.run_dir = job.runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    manifest = RunManifest(
        run_id=run_id,
        spec_version=spec_version,
        loss=cfg.loss,
        base_model=str(policy.path),
        base_revision=policy.revision,
        parent_run_id=parent.run_id if parent else None,
        parent_adapter=str(parent.adapter) if parent else None,
        watermark_from=selection.watermark_from,
        watermark_to=selection.watermark_to,
        episodes=len(episodes),
        device=str(policy.device),
    )
    start_run(engine, tracking_run_id=tracker.run_id, **manifest.row())
    try:
        with watch("tracking"):
            tracker.set_tags({"rtrl.run_id": run_id, "rtrl.spec_version": spec_version})
            tracker.log_params(
                {
                    **{f"train.{k}": v for k, v in cfg.model_dump(mode="json").items()},
                    **job.params,
                    **{k: v for k, v in asdict(manifest).items() if k != "run_id"},
                    **{f"selection.{k}": v for k, v in selection.counts.items()},
                }
            )
        rewards = [float(r.reward) for r in rows]
        with watch("loop"):  # the steps, plus recomputed behaviour and checkpoints
            if cfg.nproc > 1:  # in cfg.nproc processes (train/distributed.py), from the same start
                start = parent.adapter if parent else save_adapter(model, run_dir / "start")
                report.loop, trained = run_distributed(
                    run_dir / "ddp",
                    policy.path,
                    start,
                    episodes,
                    rewards,
                    groups,
                    cfg,
                    tracker,
                    checkpoint_dir=run_dir / "checkpoints",
                    on_step=job.on_step,
                )
            else:
                report.loop = train_policy(
                    model,
                    episodes,
                    rewards,
                    groups,
                    cfg,
                    tracker,
                    policy.tokenizer.pad_token_id,
                    checkpoint_dir=run_dir / "checkpoints",
                    on_step=job.on_step,
                )
        with watch("save"):
            if cfg.nproc > 1:
                report.adapter = Path(shutil.copytree(trained, run_dir / "adapter", dirs_exist_ok=True))
            else:
                report.adapter = save_adapter(model, run_dir / "adapter")
            (report.adapter / RUN_MANIFEST).write_text(json.dumps(manifest.adapter_file(), indent=2))
            _write_episode_manifest(run_dir / "episodes" / "episodes.jsonl", rows, episodes, report.loop.advantages)
        with watch("tracking"):
            tracker.log_artifacts(report.adapter, "adapter")
            tracker.log_artifacts(run_dir / "episodes", "episodes")
        with watch("lineage"):
            record_lineage(engine, run_id, spec_version, [(r.request_id, float(r.reward), r.outcome) for r in rows])
        summary = {
            "steps": report.loop.steps,
            "tokens": report.loop.tokens,
            "seconds": round(report.loop.seconds, 3),
            "loop_wall_s": watch.parts["loop"],
            "split_s": watch.parts,
            "final": report.loop.history[-1] if report.loop.history else {},
            "selection": selection.counts,
            "skipped": report.data.skipped,
            "behavior": report.data.behavior,
            "too_long": report.too_long,
        }
        finish_run(engine, run_id, "finished", adapter_path=str(report.adapter), summary=summary)
        tracker.end("FINISHED")
    except BaseException as exc:
        finish_run(engine, run_id, "failed", error=f"{type(exc).__name__}: {exc}")
        tracker.end("FAILED")
        raise
    finally:
        release(model)  # the base as loaded, for the next run (with keep_base_loaded)
    return report


def _write_episode_manifest(path: Path, rows: list[Any], episodes: list[TokenizedEpisode], adv: list[float]) -> None:
    """One line per trained episode: enough to find the events behind any adapter."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        for row, ep, a in zip(rows, episodes, adv):
            f.write(
                orjson.dumps(
                    {
                        "request_id": row.request_id,
                        "interaction_event_id": row.event_id,
                        "reward_id": row.reward_id,
                        "reward": row.reward,
                        "advantage": round(a, 6),
                        "policy_version": row.policy_version,
                        "tenant": row.tenant,
                        "behavior": ep.behavior_note,
                        "tokens": len(ep.input_ids),
                    }
                )
                + b"\n"
            )
