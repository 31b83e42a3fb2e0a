"""One cycle of the loop, as a state machine persisted in the store:

    pending -> rewarding -> training -> evaluating -> promoting -> done
                   \\-> skipped (too few new rewarded episodes)   \\-> rejected (the gate said no)
    any state -> failed (an error: recorded, the next cycle starts afresh)

With a staged rollout (`[rollout] share` > 0) a candidate that passed the gate goes through

    evaluating -> staging -> canary -> promoting -> done
                               \\-> rejected (online worse than the champion, or too little traffic)

`canary` waits for live traffic: the cycle returns and every later run (the daemon checks
every `rollout.check_every`) resumes it, rewards what the canary served, and once both sides
have enough requests lets deploy/rollout.py decide. No new candidate is trained meanwhile.

Each state is written before its work starts, fenced by the daemon's lease (pipeline/core/store/
leases.py): a daemon whose lease another took over stops at its next write or training step.
After a crash, `run_cycle` resumes the unfinished cycle from the state it reached, and every
stage's work is idempotent when re-entered:

    rewarding   run_rewards is incremental
    training    a finished training run recorded on the cycle is reused; one that died is
                marked failed and trained again
    evaluating  a gate decision stored for the cycle's run is reused
    staging     stage() of the current canary is a no-op
    canary      an online decision recorded for the cycle is reused; a check that fails (the
                store or the registry away) leaves the cycle in canary, retried next time; a
                new cycle first withdraws a canary no cycle is measuring
    promoting   promote() of the current champion is a no-op; registry.repair(), first thing in
                every cycle, completes a move a crash interrupted
"""

from __future__ import annotations

import logging
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from deploy import rollout
from deploy.registry import ANY, CANARY, CHAMPION, Registry, Superseded
from deploy.stage import gate_run
from deploy.suite import EMPTY, Suite
from pipeline.core.config import Config, duration_s
from pipeline.core.faults import pause_point
from pipeline.core.store.cycles import create_cycle, decision_for_run, get_cycle, set_cycle, unfinished_cycle
from pipeline.core.store.deploys import last_move_to, latest_decision, online_rewards
from pipeline.core.store.events import utcnow
from pipeline.core.store.leases import Fence, LeaseLost
from pipeline.core.store.training import finish_run, get_run, latest_finished_run
from reward.spec import RewardSpec
from reward.stage import run_rewards
from train.run import NothingToTrain, Parent, run_training, select
from train.tracking import Tracker

log = logging.getLogger("rtrl.cycle")


@dataclass
class CycleDeps:
    """What a cycle works with; the daemon, the demo and tests build it."""

    engine: Engine
    config: Config
    spec: RewardSpec
    registry: Registry
    make_tracker: Callable[[str], Tracker]  # cycle id -> a tracker for its training run
    make_runner: Callable[[Path], Any]  # base model -> a deploy.evaluate.Runner (may be kept between cycles)
    suite: Suite = EMPTY
    owner: str | None = None  # the daemon running the cycle (recorded on the row)
    # the daemon's lease fencing token: every state write (and, through the registry, every
    # decision and alias move) happens only while the lease is still this one; None: unfenced
    fence: Fence | None = None


def default_deps(config: Config, engine: Engine, spec: RewardSpec) -> CycleDeps:
    """The real parts: MLflow tracking and registry from the config, model-update events on
    Kafka, models loaded with train.inference, the configured regression suite."""
    from deploy.events import ModelUpdatePublisher
    from deploy.suite import load_suite
    from deploy.tracking import MlflowTracker
    from train.inference import PolicySet
    from train.models import import_model_code, set_cpu_threads

    set_cpu_threads(config.train.cpu_threads)  # the gate's evaluation runs in this process too
    if config.train.base_model is not None:
        # at start, not in the middle of the first cycle (seconds of imports); a bad path fails here
        import_model_code(config.train.base_model)
    publisher = ModelUpdatePublisher(config.kafka_access, config.kafka.model_updates_topic)
    registry = Registry(config.tracking_uri, config.mlflow.registered_model, engine, publisher,
                        cache_dir=config.state_dir / "cache" / "adapters")
    resident: dict[Path, PolicySet] = {}

    def make_runner(base: Path) -> PolicySet:
        # one set of evaluation weights for the daemon's life: the base model is not loaded again
        # every cycle, and the champion's adapter stays loaded while it is the champion
        base = Path(base).resolve()
        if base not in resident:
            resident.clear()
            resident[base] = PolicySet.load(base, device=config.train.torch_device)
        return resident[base]

    return CycleDeps(
        engine, config, spec, registry,
        make_tracker=lambda cycle_id: MlflowTracker(config.tracking_uri, config.mlflow.experiment,
                                                    config.artifact_root, run_name=cycle_id),
        make_runner=make_runner,
        suite=load_suite(config.gate.suite) if config.gate.suite else EMPTY,
    )


def run_cycle(deps: CycleDeps) -> Any:
    """Run one cycle, or finish the one a crash interrupted; returns its row (None if the lease
    was lost: the row is the new holder's). Never raises for a failing stage: the cycle ends
    `failed` with the reason; a lost lease stops it where it is, for the new holder to resume."""
    deps.registry.fence = deps.fence
    row = unfinished_cycle(deps.engine)
    if row is None:
        cycle_id = f"c-{uuid.uuid4().hex[:12]}"
        try:
            create_cycle(deps.engine, cycle_id, deps.owner, fence=deps.fence)
        except LeaseLost as exc:
            log.warning("cycle not started: the lease is lost", extra={"error": str(exc)})
            return None
        row = get_cycle(deps.engine, cycle_id)
    elif row.state != "canary":  # a canary waiting on traffic is not an interruption
        log.info("resuming an interrupted cycle", extra={"cycle": row.cycle_id, "state": row.state})
    cycle_id, timings = row.cycle_id, dict(row.timings or {})
    t_cycle = time.perf_counter()
    # `bookkeeping`: what this call spent outside its timed stages (reading and writing the cycle's
    # state, registry lookups between stages), so that the stage timings add up to the cycle's time
    untimed_before, timed_s, stage_started = timings.get("bookkeeping", 0.0), 0.0, None

    def enter(state: str, **values: Any) -> None:
        now = time.perf_counter()
        in_stage = now - stage_started if stage_started is not None else 0.0  # (training enters "training")
        timings["bookkeeping"] = round(untimed_before + now - t_cycle - timed_s - in_stage, 3)
        set_cycle(deps.engine, cycle_id, fence=deps.fence, state=state, timings=timings, **values)

    def timed(stage: str, fn: Callable[[], Any]) -> Any:
        nonlocal timed_s, stage_started
        stage_started = time.perf_counter()
        try:
            return fn()
        finally:
            seconds = time.perf_counter() - stage_started
            timed_s, stage_started = timed_s + seconds, None
            timings[stage] = round(timings.get(stage, 0.0) + seconds, 3)

    try:
        state, run_id = row.state, row.run_id
        # an alias move a crash interrupted (its audit row completed), a model-update event the
        # broker was not there for (sent): whatever this cycle then does, serving learns the champion
        timed("repair", deps.registry.repair)
        if state == "pending":
            timed("repair", lambda: _withdraw_orphan_canary(deps))
        if state in ("pending", "rewarding"):
            enter("rewarding")
            timed("reward", lambda: run_rewards(deps.engine, deps.spec))
            state = "training"
        if state == "training":
            with tempfile.TemporaryDirectory() as tmp:
                champion = deps.registry.alias(CHAMPION)  # training continues from the champion's adapter
                parent = timed("parent", lambda: Parent.from_adapter(deps.registry.adapter(champion, Path(tmp)))
                               ) if champion else None
                run_id = timed("train", lambda: _train(deps, cycle_id, run_id, parent, enter))
            if run_id is None:
                return get_cycle(deps.engine, cycle_id)  # skipped
            state = "evaluating"
        if state == "evaluating":
            enter("evaluating", run_id=run_id)
            decision = decision_for_run(deps.engine, run_id)
            if decision is None:
                result = timed("evaluate", lambda: gate_run(
                    deps.engine, deps.registry, deps.make_runner(Path(get_run(deps.engine, run_id).base_model)),
                    run_id, deps.spec.version, deps.config.train, deps.config.gate, deps.suite,
                    deps.spec.guards.abstention.patterns, cycle_id=cycle_id))
                passed, version, reasons = result.decision.passed, result.version.version, result.decision.reasons
            else:
                passed, version = bool(decision.passed), decision.candidate_version
                reasons = [c["detail"] for c in decision.report["decision"]["checks"] if not c["passed"]]
            if not passed:
                enter("rejected", candidate_version=version, promoted=0, reason="; ".join(reasons))
                return get_cycle(deps.engine, cycle_id)
            state = "staging" if deps.config.rollout.share > 0 else "promoting"
            enter(state, candidate_version=version)
        if state == "staging":
            version = get_cycle(deps.engine, cycle_id).candidate_version
            timed("stage", lambda: deps.registry.stage(version, deps.config.rollout.share, actor="automatic",
                                                       reason=f"cycle {cycle_id}: gate passed"))
            enter("canary")
            return get_cycle(deps.engine, cycle_id)  # live traffic decides, at a later run
        if state == "canary":
            version = get_cycle(deps.engine, cycle_id).candidate_version
            try:
                verdict = timed("online", lambda: _online_decision(deps, cycle_id, version))
                if verdict is not None and not verdict[0]:
                    timed("withdraw", lambda: deps.registry.withdraw_canary(
                        version, "automatic", f"canary rejected online: {verdict[1]}"))
            except Exception as exc:  # noqa: BLE001 - the canary keeps serving; failing here would orphan it
                log.warning("canary check failed; retried at the next check", extra={
                    "cycle": cycle_id, "error": f"{type(exc).__name__}: {exc}"})
                enter("canary", reason=f"last check failed: {type(exc).__name__}: {exc}"[:2000])
                return get_cycle(deps.engine, cycle_id)
            if verdict is None:
                enter("canary")  # still measuring (the row's updated_at says when it was last checked)
                return get_cycle(deps.engine, cycle_id)
            passed, why = verdict
            if not passed:
                enter("rejected", promoted=0, reason=why)
                return get_cycle(deps.engine, cycle_id)
            enter("promoting", reason=why)  # the online comparison's numbers stay on the cycle
            state = "promoting"
        if state == "promoting":
            version = get_cycle(deps.engine, cycle_id).candidate_version
            passed_what = "gate and canary passed" if deps.config.rollout.share > 0 else "gate passed"
            # decided against the champion of then: an operator's rollback or promotion meanwhile wins
            decided = latest_decision(deps.engine, deps.registry.name, version)
            try:
                timed("promote", lambda: deps.registry.promote(
                    version, actor="automatic", reason=f"cycle {cycle_id}: {passed_what}",
                    against=decided.champion_version if decided is not None else ANY))
            except Superseded as exc:
                enter("rejected", promoted=0, reason=f"not promoted: {exc}")
                return get_cycle(deps.engine, cycle_id)
            enter("done", promoted=1)
    except LeaseLost as exc:  # another daemon holds the lease now: it resumes this cycle; write nothing
        log.warning("cycle stopped: the lease was lost", extra={"cycle": cycle_id, "error": str(exc)})
        return None
    except Exception as exc:  # noqa: BLE001 - the daemon outlives a failed cycle
        log.exception("cycle failed", extra={"cycle": cycle_id})
        try:
            enter("failed", reason=f"{type(exc).__name__}: {exc}")
        except LeaseLost:
            log.warning("cycle failure not recorded: the lease was lost", extra={"cycle": cycle_id})
    finally:
        total = time.perf_counter() - t_cycle
        if total > deps.config.cycle.sla_s:
            log.warning("cycle exceeded its SLA", extra={"cycle": cycle_id, "seconds": round(total, 1),
                                                         "sla_s": deps.config.cycle.sla_s})
    return get_cycle(deps.engine, cycle_id)


def cycle_split(engine: Engine, row: Any, run: Any | None) -> dict[str, float]:
    """A finished cycle's seconds by part: its stages, with its training run's split
    (`train.load`, `train.loop` -- the training loop --, ...) and the gate's (`evaluate.generate`,
    ...); `<stage>.other` is what the stage spent around its parts. `run`: the cycle's training
    run row (None if it has none)."""
    decision = decision_for_run(engine, row.run_id) if row.run_id else None
    inner = {"train": (run.summary or {}).get("split_s", {}) if run is not None else {},
             "evaluate": decision.report.get("seconds", {}) if decision is not None else {}}
    out: dict[str, float] = {}
    for stage, seconds in (row.timings or {}).items():
        parts = inner.get(stage, {})
        for part, s in parts.items():
            out[f"{stage}.{part}"] = s
        out[f"{stage}.other" if parts else stage] = round(max(seconds - sum(parts.values()), 0.0), 4)
    return out


def _train(deps: CycleDeps, cycle_id: str, run_id: str | None, parent: Parent | None,
           enter: Callable[..., None]) -> str | None:
    """The cycle's finished training run id, training if needed; None when the cycle is skipped."""
    if run_id is not None:
        run = get_run(deps.engine, run_id)
        if run is not None and run.status == "finished":
            return run_id
        if run is not None and run.status == "running":  # the process died mid-training
            finish_run(deps.engine, run_id, "failed", error=f"abandoned: cycle {cycle_id} was interrupted")
    cfg, runs_dir = deps.config.train, deps.config.state_dir / "runs"
    selection = select(deps.engine, cfg, deps.spec.version, parent)
    new, since = selection.counts["selected"], ""
    # a candidate already trained from this champion was not promoted (or was rolled back): its
    # episodes are selected again, which is right, but training again needs enough episodes it
    # never saw; otherwise every cycle would register a near-copy of a rejected candidate. One
    # from a cycle that failed (before the gate decided, or before its promotion) does not count:
    # that cycle is retried with the same episodes
    last = latest_finished_run(deps.engine, deps.spec.version, watermark_from=selection.watermark_from,
                               skip_failed_cycles=True)
    if last is not None:
        new = sum(1 for r in selection.rows if r.reward_id > last.watermark_to)
        since = f" since run {last.run_id[:12]} (the last candidate trained from this champion)"
    if new < deps.config.cycle.min_new_episodes:
        enter("skipped", reason=f"{new} new rewarded episodes{since}, fewer than cycle.min_new_episodes "
                                f"({deps.config.cycle.min_new_episodes})")
        return None
    run_id = uuid.uuid4().hex
    enter("training", run_id=run_id)  # recorded first: a crash mid-training is found on resume
    tracker = deps.make_tracker(cycle_id)
    tracker.set_tags({"rtrl.cycle": cycle_id})
    try:
        run_training(deps.engine, cfg, deps.spec.version, runs_dir, tracker, parent, params={"cycle": cycle_id},
                     run_id=run_id, selection=selection, on_step=_fence_check(deps))
    except NothingToTrain as exc:
        tracker.end("KILLED")
        enter("skipped", reason=str(exc))
        return None
    return run_id


def _fence_check(deps: CycleDeps, every_s: float = 1.0) -> Callable[..., None] | None:
    """A training step callback that stops a run whose daemon lost the lease (at most one store
    read a second, and always at the last step, before the run is recorded finished): a run can
    last hours, and the new holder is training the cycle again."""
    if deps.fence is None:
        return None
    last = [time.monotonic()]

    def check(step: int, total: int, *_: Any) -> None:
        if step >= total or time.monotonic() - last[0] >= every_s:
            last[0] = time.monotonic()
            with deps.engine.connect() as conn:
                deps.fence.check(conn)

    return check


def _online_decision(deps: CycleDeps, cycle_id: str, version: str) -> tuple[bool, str] | None:
    """(passed, reason) once the canary's online comparison is made (or an operator decided),
    None while it still needs traffic. The decision is recorded once; a resumed cycle reads it."""
    registry, cfg = deps.registry, deps.config.rollout
    decision = latest_decision(deps.engine, registry.name, version)
    if decision is not None and decision.report.get("stage") == "online" and decision.report.get("cycle") == cycle_id:
        return _verdict(bool(decision.passed), decision.report["decision"]["checks"])
    champion, canary = registry.alias(CHAMPION), registry.alias(CANARY)
    if champion is not None and champion.version == version:
        return True, f"version {version} was promoted by an operator during its canary"
    if canary is None or canary.version != version:
        return False, f"the canary (version {version}) was withdrawn by an operator"
    move = last_move_to(deps.engine, registry.name, CANARY, version)
    # the canary went live with its move (an alias set by hand has none: the cycle's start)
    staged_at = move.at if move is not None else get_cycle(deps.engine, cycle_id).started_at
    # rewards for what both sides served since: only that window is read (the cycle's own reward
    # stage brings the rest of the history up to date), so a check costs the same on any store
    run_rewards(deps.engine, deps.spec, served_since=staged_at)
    # only requests whose outcome is final (the spec's ripeness window has passed): an early
    # terminal signal would otherwise over-represent the outcomes that arrive fast
    settled = utcnow() - timedelta(seconds=deps.spec.ripeness.window_s)
    serving = champion.version if champion else "base"
    sides = online_rewards(deps.engine, deps.spec.version, [serving, version], staged_at, until=settled)
    if rollout.ready(sides.get(serving), sides.get(version), cfg):
        result = rollout.decide(sides[serving], sides[version], cfg)
    elif (utcnow() - staged_at).total_seconds() > duration_s(cfg.max_wait):
        result = rollout.too_little_traffic(sides.get(serving), sides.get(version), cfg)
    else:
        log.info("canary still measuring", extra={"cycle": cycle_id, "version": version, "min_requests":
                                                 cfg.min_requests, "rewarded": {v: s[0] for v, s in sides.items()}})
        return None
    decided = result.to_dict()
    registry.record_online(version, champion.version if champion else None, cycle_id, decided,
                           {v: {"n": s[0], "mean": s[1], "var": s[2]} for v, s in sides.items()})
    pause_point("canary.decided")  # crash tests kill the process here: a restart reuses the decision
    return _verdict(result.passed, decided["checks"])


def _verdict(passed: bool, checks: list[dict[str, Any]]) -> tuple[bool, str]:
    """A decision as (passed, reason): the failing checks, or every check's numbers on a pass."""
    return passed, "; ".join(c["detail"] for c in checks if passed or not c["passed"])


def _withdraw_orphan_canary(deps: CycleDeps) -> None:
    """A new cycle starts only when no cycle is measuring a canary: a canary alias left from a
    cycle that failed after staging it (its promotion failed, say) serves no purpose -- withdrawn."""
    withdrawn = deps.registry.unstage("automatic", "no cycle is measuring this canary (its cycle ended)")
    if withdrawn is not None:
        log.warning("withdrew a canary no cycle was measuring", extra={"version": withdrawn.version})

