"""Keeping the outcome model (train/outcome.py) fresh as the store grows.

    select   the most recent `outcome.max_episodes` rewarded episodes of the training slice
             (never the gate's held-out one), as training selects them (store/training.py)
    refresh  fitted again when `outcome.refresh_episodes` of them are newer than the last fit's
             window (or there is none, or the base model, the spec or the pooling changed);
             else the last one, loaded
             once per process
    record   <state>/outcome/<id>/ (adapter, head, outcome.json: window, figures, usable or
             not and why), <state>/outcome/latest.json naming it, and a tracker run (MLflow:
             params, the check's figures as metrics, the model as artifacts)

What the gate gets is an OutcomeScorer (deploy/fresh.py): a fitted model, or an unfitted one that
says why (too few rewarded episodes) -- which the gate reports as the reason it fell back.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import Engine

from pipeline.core.config import OutcomeConfig, TrainConfig
from pipeline.core.store.training import select_episodes
from pipeline.core.types import LoggedEpisode, sampling_params
from train.outcome import Fitted, OutcomeModel, fit
from train.outcome_record import MANIFEST, latest, point_at
from train.tracking import Tracker

log = logging.getLogger("rtrl.outcome")


@dataclass
class Scorer:
    """A fitted outcome model as the gate uses it."""

    model: OutcomeModel
    manifest: dict[str, Any]

    @property
    def usable(self) -> bool:
        return bool(self.manifest["usable"])

    @property
    def why(self) -> str:
        return self.manifest["why"]

    def score(self, episodes: list[LoggedEpisode]) -> list[float | None]:
        return self.model.score(episodes)


@dataclass
class Unfitted:
    why: str
    usable: bool = False

    def score(self, episodes: list[LoggedEpisode]) -> list[float | None]:
        raise RuntimeError(f"the outcome model {self.why}")


_LOADED: dict[str, Scorer] = {}  # path -> the model loaded from it: one at a time


def _load(manifest: dict[str, Any], device: str | None) -> Scorer:
    path = manifest["path"]
    if path not in _LOADED:
        _LOADED.clear()
        _LOADED[path] = Scorer(OutcomeModel.load(path, device=device), manifest)
    return _LOADED[path]


def _episode(row: Any) -> LoggedEpisode | None:
    try:
        ev = orjson.loads(row.body)
        sampling = sampling_params(ev.get("sampling"))
    except ValueError:  # orjson's decode error is one; an unreadable sampling block another
        return None
    if ev.get("truncated") or "prompt" not in ev:
        return None
    return LoggedEpisode(
        row.request_id,
        ev["prompt"],
        ev.get("completion", ""),
        ev.get("completion_token_ids"),
        None,
        sampling.temperature,
        float(row.reward),
        sampling.top_p,
        sampling.top_k,
        ev.get("tools"),
    )


def refresh(
    engine: Engine,
    cfg: OutcomeConfig,
    train: TrainConfig,
    spec_version: str,
    state_dir: Path,
    make_tracker: Callable[[], Tracker] | None = None,
    force: bool = False,
) -> Scorer | Unfitted:
    """The outcome model the gate should use now (see the module docstring); `make_tracker`
    opens the run a new fit is recorded in; `force`: fit again whatever the last fit's window."""
    if not cfg.enabled:
        return Unfitted("is off (outcome.enabled = false)")
    if not train.base_model:
        return Unfitted("is missing: train.base_model is not set (the outcome model is fitted on the policy's base)")
    base = str(Path(train.base_model).resolve())
    selection = select_episodes(
        engine, spec_version, tenant=train.tenant, limit=cfg.max_episodes, holdout_percent=train.holdout_percent
    )
    try:
        last = latest(state_dir)
    except ValueError as exc:  # an unreadable record: fitted again, and replaced
        log.warning("fitting the outcome model again", extra={"reason": str(exc)})
        last = None
    if not force and last is not None and fitted_as_asked(last, base, spec_version, cfg):
        newer = sum(1 for r in selection.rows if r.reward_id > last["window"]["to_reward_id"])
        if newer < cfg.refresh_episodes:
            return _load(last, train.torch_device)
    pairs = [(e, selection.tasks.get(r.request_id)) for r in selection.rows if (e := _episode(r)) is not None]
    window = {
        "spec_version": spec_version,
        "from_reward_id": min((r.reward_id for r in selection.rows), default=0),
        "to_reward_id": selection.watermark_to,
        "episodes": len(pairs),
        "served_from": str(min((r.ts for r in selection.rows), default="")),
        "served_to": str(max((r.ts for r in selection.rows), default="")),
    }
    out = state_dir / "outcome" / uuid.uuid4().hex[:12]
    try:
        fitted = fit(base, [e for e, _ in pairs], [t for _, t in pairs], out, cfg, train, window)
    except ValueError as exc:  # too few episodes: the gate says so and falls back
        log.info("no outcome model yet", extra={"reason": str(exc)})
        return Unfitted(f"is missing: {exc}")
    except Exception as exc:  # noqa: BLE001 - a base it cannot fit on must not stop the cycle: the gate says why
        log.error("could not fit the outcome model", extra={"error": f"{type(exc).__name__}: {exc}"})
        return Unfitted(f"could not be fitted ({type(exc).__name__}: {exc})")
    point_at(state_dir, out)
    log.info(
        "outcome model fitted",
        extra={
            "path": str(out),
            "usable": fitted.usable,
            "why": fitted.why,
            "episodes": fitted.episodes,
            "seconds": fitted.seconds,
        },
    )
    if make_tracker is not None:
        _track(make_tracker, fitted)
    return _load(json.loads((out / MANIFEST).read_text()), train.torch_device)


def fitted_as_asked(last: dict[str, Any], base: str, spec_version: int, cfg: OutcomeConfig) -> bool:
    """Whether the last fit (its outcome.json) was made as the config now asks: on this base,
    for this reward spec, with this pooling (a head of the other pooling reads other features,
    so a change of setting is a new fit, not a reload)."""
    return (
        last["base_model"] == base
        and last["window"].get("spec_version") == spec_version
        and last.get("pooling", "last") == cfg.pooling
    )


def _track(make_tracker: Callable[[], Tracker], fitted: Fitted) -> None:
    try:
        tracker = make_tracker()
        tracker.set_tags({"rtrl.kind": "outcome_model", "rtrl.usable": str(fitted.usable)})
        tracker.log_params(
            {
                "base_model": fitted.base_model,
                **{f"episodes_{k}": v for k, v in fitted.episodes.items()},
                **{f"window_{k}": v for k, v in fitted.window.items()},
            }
        )
        q = fitted.quality
        tracker.log_metrics(
            {
                "auroc": q.auroc,
                "brier": q.brier,
                "brier_baseline": q.brier_baseline,
                "calibration_error": q.calibration_error,
                "r2": q.r2,
                "seconds": fitted.seconds,
            },
            0,
        )
        tracker.log_artifacts(fitted.path, "outcome_model")
        tracker.end("FINISHED")
    except Exception as exc:  # noqa: BLE001 - the tracker is a report: the model itself is kept on disk
        log.warning("could not record the outcome model's run", extra={"error": f"{type(exc).__name__}: {exc}"})
