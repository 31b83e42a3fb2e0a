"""The training stage: select rewarded episodes, train a LoRA update, record everything.

    select     rewards of the spec created after the parent's watermark, served within the
               staleness budget, optionally one tenant (pipeline/core/store/training.py)
    load       the base model; the parent's adapter (the champion's) trainable, else a fresh one
    tokenize   assistant-only loss masks, behaviour log-probs aligned or dropped (train/data.py)
    train      train/loop.py
    record     <run>/adapter (safetensors + rtrl_run.json: run id, data watermark, base model),
               <run>/episodes.jsonl (the exact episodes and rewards), the lineage rows, the
               training_runs row, and the tracker's run (params, per-step metrics, artifacts)

An adapter directory carries its own data watermark in rtrl_run.json: continuing from it reads
only rewards the parent never saw.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import torch
from sqlalchemy import Engine

from pipeline.core.config import TrainConfig
from pipeline.core.store.events import utcnow
from pipeline.core.store.training import (
    Selection,
    finish_run,
    latest_finished_run,
    record_lineage,
    select_episodes,
    start_run,
)
from pipeline.core.timing import Stopwatch
from pipeline.core.types import sampling_params, task_key
from train.data import DataStats, Skip, TokenizedEpisode, tokenize_episode
from train.distributed import run_distributed
from train.loop import LoopResult, train_policy
from train.lora import attach_adapter, load_adapter, release, resident_base, save_adapter, set_gradient_checkpointing
from train.models import ModelError, load_policy, set_cpu_threads
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


def select(
    engine: Engine,
    cfg: TrainConfig,
    spec_version: str,
    parent: Parent | None,
    now: datetime | None = None,
    since: int | None = None,
) -> Selection:
    watermark = since if since is not None else (parent.watermark if parent else 0)
    served_after = (now or utcnow()) - timedelta(seconds=cfg.staleness_s) if cfg.staleness_s else None
    return select_episodes(
        engine,
        spec_version,
        since_reward_id=watermark,
        served_after=served_after,
        tenant=cfg.tenant,
        limit=cfg.max_episodes,
        holdout_percent=cfg.holdout_percent,
    )


def unseen_episodes(engine: Engine, spec_version: str, selection: Selection) -> tuple[int, str]:
    """How many selected episodes no candidate trained from the same champion has seen, and
    since which run ("" when none was). A candidate trained from this champion that was not
    promoted (or was rolled back) leaves its episodes selectable, which is right, but training
    again on them alone would register a near-copy of a rejected candidate; the caller trains
    only once enough are new. A run of a cycle that failed (before its gate decided, or before
    its promotion) does not count: that cycle is retried with the same episodes."""
    last = latest_finished_run(engine, spec_version, watermark_from=selection.watermark_from, skip_failed_cycles=True)
    if last is None:
        return selection.counts["selected"], ""
    return (
        sum(1 for r in selection.rows if r.reward_id > last.watermark_to),
        f" since run {last.run_id[:12]} (the last candidate trained from this champion)",
    )


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


def tokenize_selection(
    tokenizer: Any, selection: Selection, cfg: TrainConfig, report: TrainReport
) -> tuple[list[TokenizedEpisode], list[Any], list[str]]:
    """Tokenized episodes, the selection rows they came from, and each one's group (episodes of
    the same task -- first user message -- for group-relative advantages); skips counted in `report`."""
    episodes, rows, groups = [], [], []
    for row in selection.rows:
        try:
            ev = orjson.loads(row.body)
        except orjson.JSONDecodeError:
            report.unreadable += 1
            continue
        if ev.get("truncated"):
            report.data.count(report.data.skipped, Skip.TRUNCATED.value)
            continue
        try:
            sampling = sampling_params(ev.get("sampling"))
        except ValueError:
            report.data.count(report.data.skipped, Skip.BAD_SAMPLING.value)
            continue
        out = tokenize_episode(
            tokenizer,
            row.request_id,
            ev.get("prompt", ""),
            ev.get("completion", ""),
            ev.get("completion_token_ids"),
            ev.get("behavior_logprobs"),
            report.data,
            tools=ev.get("tools"),
        )
        if isinstance(out, Skip):
            continue
        if len(out.input_ids) > cfg.max_seq_len:
            report.too_long += 1
            continue
        out.sample_with(sampling)
        episode = ev.get("episode_id")
        out.episode = episode if isinstance(episode, str) else None
        episodes.append(out)
        rows.append(row)
        task = selection.tasks.get(row.request_id)  # its episode's task, for an agent's call
        groups.append(hashlib.sha1(task if task is not None else task_key(ev.get("prompt", ""))).hexdigest())
    return episodes, rows, groups


def run_training(
    engine: Engine,
    cfg: TrainConfig,
    spec_version: str,
    runs_dir: Path,
    tracker: Tracker,
    parent: Parent | None = None,
    since: int | None = None,
    dry_run: bool = False,
    now: datetime | None = None,
    params: dict[str, Any] | None = None,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
    run_id: str | None = None,
    selection: Selection | None = None,
) -> TrainReport:
    """One training run; with `dry_run`, only the selection (nothing loaded, nothing written).
    `run_id` lets a caller record the id before the run starts (a cycle that may crash);
    `selection`, one it already made with select() (a cycle that counted it first)."""
    selection = selection or select(engine, cfg, spec_version, parent, now, since)
    report = TrainReport(
        run_id=None,
        selection=selection.counts,
        watermark_from=selection.watermark_from,
        watermark_to=selection.watermark_to,
        by_policy_version=dict(Counter(r.policy_version for r in selection.rows)),
    )
    if dry_run:
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

    run_id = report.run_id = run_id or uuid.uuid4().hex
    run_dir = report.run_dir = runs_dir / run_id
    run_dir.mkdir(parents=True, exist_ok=True)
    start_run(
        engine,
        run_id=run_id,
        tracking_run_id=tracker.run_id,
        spec_version=spec_version,
        loss=cfg.loss,
        base_model=str(policy.path),
        base_revision=policy.revision,
        parent_run_id=parent.run_id if parent else None,
        watermark_from=selection.watermark_from,
        watermark_to=selection.watermark_to,
        episodes=len(episodes),
    )
    try:
        with watch("tracking"):
            tracker.set_tags({"rtrl.run_id": run_id, "rtrl.spec_version": spec_version})
            tracker.log_params(
                {
                    **{f"train.{k}": v for k, v in cfg.model_dump(mode="json").items()},
                    **(params or {}),
                    "spec_version": spec_version,
                    "base_model": str(policy.path),
                    "base_revision": policy.revision,
                    "parent_adapter": str(parent.adapter) if parent else None,
                    "parent_run_id": parent.run_id if parent else None,
                    "watermark_from": selection.watermark_from,
                    "watermark_to": selection.watermark_to,
                    "episodes": len(episodes),
                    "device": policy.device,
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
                    on_step=on_step,
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
                    on_step=on_step,
                )
        with watch("save"):
            if cfg.nproc > 1:
                report.adapter = Path(shutil.copytree(trained, run_dir / "adapter", dirs_exist_ok=True))
            else:
                report.adapter = save_adapter(model, run_dir / "adapter")
            manifest = {
                "run_id": run_id,
                "watermark": selection.watermark_to,
                "spec_version": spec_version,
                "loss": cfg.loss,
                "base_model": str(policy.path),
                "base_revision": policy.revision,
                "parent_run_id": parent.run_id if parent else None,
                "episodes": len(episodes),
            }
            (report.adapter / RUN_MANIFEST).write_text(json.dumps(manifest, indent=2))
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
