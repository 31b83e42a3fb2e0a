"""One cycle of the loop, as a state machine persisted in the store:

    pending -> rewarding -> training -> evaluating -> promoting -> done
                   \\-> skipped (too few new rewarded episodes)   \\-> rejected (the gate said no)
    any state -> failed (an error: recorded, the next cycle starts afresh)

With a staged rollout (`[rollout] share` > 0) a candidate that passed the gate goes through

    evaluating -> staging -> canary -> promoting -> done
                               \\-> rejected (online worse than the champion, or too little traffic)

`canary` waits for live traffic: the cycle returns and every later run (the daemon checks
every `rollout.check_every`) resumes it, rewards what the canary served and looks at the
sequential test (deploy/rollout.py), until it decides; meanwhile the cycle's reason is the test's
progress. No new candidate is trained meanwhile.

Each state is written before its work starts, fenced by the daemon's lease (pipeline/core/store/
leases.py): a daemon whose lease another took over stops at its next write or training step,
and one shutting down (CycleDeps.stopping) before its next stage or training step.
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

In the code the states are CycleState (pipeline/core/store/cycles.py) and HANDLERS maps each
non-terminal one to its handler, which returns the next. The handlers only sequence the stages:
the work and its rules live in reward/stage.py, train/run.py and train/selection.py (including
when there is enough new data to train again) and deploy/stage.py (the gate, the canary's online decision).
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from deploy.registry import ANY, CHAMPION, Registry, Superseded
from deploy.stage import CanaryJob, GateJob, gate_run, online_decision, withdraw_orphan_canary
from deploy.suite import EMPTY, Suite
from pipeline.core.config import Config
from pipeline.core.store.cycles import CycleRecord, CycleState, create_cycle, get_cycle, set_cycle, unfinished_cycle
from pipeline.core.store.deploys import decision_for_run, latest_decision
from pipeline.core.store.leases import Fence, LeaseLost
from pipeline.core.store.training import finish_run, get_run
from reward.spec import RewardSpec
from reward.stage import run_rewards
from train.outcome_stage import refresh as refresh_outcome
from train.run import NothingToTrain, Parent, TrainJob, run_training
from train.selection import select, unseen_episodes
from train.tracking import Tracker

S = CycleState

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
    # set when the daemon shuts down: the cycle stops before its next stage or training step and
    # resumes from its state at the next start (a gate run while the process exits would fall
    # back from an outcome model it can no longer load, and stage what it passed)
    stopping: threading.Event | None = None


class Stopping(BaseException):
    """The daemon is shutting down. A BaseException, as KeyboardInterrupt: no stage's handler of
    its own failures may turn it into a failed stage or a failed canary check."""


def default_deps(config: Config, engine: Engine, spec: RewardSpec) -> CycleDeps:
    """The real parts: MLflow tracking and registry from the config, model-update events on
    Kafka, models loaded with train.inference, the configured regression suite."""
    from deploy.serving.events import ModelUpdatePublisher
    from deploy.suite import load_suite
    from deploy.tracking import MlflowTracker
    from train.inference import PolicySet
    from train.models import import_model_code, set_cpu_threads

    set_cpu_threads(config.train.cpu_threads)  # the gate's evaluation runs in this process too
    if config.train.base_model is not None:
        # at start, not in the middle of the first cycle (seconds of imports); a bad path fails here
        import_model_code(config.train.base_model)
    publisher = ModelUpdatePublisher(config.kafka_access, config.kafka.model_updates_topic)
    registry = Registry(
        config.tracking_uri,
        config.mlflow.registered_model,
        engine,
        publisher,
        cache_dir=config.state_dir / "cache" / "adapters",
    )
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
        engine,
        config,
        spec,
        registry,
        make_tracker=lambda cycle_id: MlflowTracker(
            config.tracking_uri, config.mlflow.experiment, config.artifact_root, run_name=cycle_id
        ),
        make_runner=make_runner,
        suite=load_suite(config.gate.suite) if config.gate.suite else EMPTY,
    )


class _Cycle:
    """One call of run_cycle on one cycle row: what its handlers share (the deps, the row's ids)
    and the bookkeeping of where its seconds went."""

    def __init__(self, deps: CycleDeps, row: CycleRecord) -> None:
        self.deps, self.cycle_id, self.run_id = deps, row.cycle_id, row.run_id
        self.timings = dict(row.timings or {})
        self.started = time.perf_counter()
        # `bookkeeping`: what this call spent outside its timed stages (reading and writing the
        # cycle's state, registry lookups between stages), so that the stage timings add up to
        # the cycle's time
        self.untimed_before, self.timed_s, self.stage_started = self.timings.get("bookkeeping", 0.0), 0.0, None

    def enter(self, state: CycleState, **values: Any) -> None:
        """Write the cycle's state (fenced by the lease), before the state's work starts."""
        now = time.perf_counter()
        # (training enters "training" from inside its timed stage)
        in_stage = now - self.stage_started if self.stage_started is not None else 0.0
        self.timings["bookkeeping"] = round(self.untimed_before + now - self.started - self.timed_s - in_stage, 3)
        set_cycle(self.deps.engine, self.cycle_id, fence=self.deps.fence, state=state, timings=self.timings, **values)

    def timed(self, stage: str, fn: Callable[[], Any]) -> Any:
        if self.deps.stopping is not None and self.deps.stopping.is_set():
            raise Stopping(f"before {stage}")
        self.stage_started = time.perf_counter()
        try:
            return fn()
        finally:
            seconds = time.perf_counter() - self.stage_started
            self.timed_s, self.stage_started = self.timed_s + seconds, None
            self.timings[stage] = round(self.timings.get(stage, 0.0) + seconds, 3)

    def row(self) -> CycleRecord:
        row = get_cycle(self.deps.engine, self.cycle_id)
        if row is None:  # cycles are never deleted: a store that lost one is not this daemon's to repair
            raise LookupError(f"cycle {self.cycle_id} is no longer in the store")
        return row


# One handler per non-terminal state. Each does its state's work and returns the state to run
# next, or None when the cycle stops here for this call: it reached a terminal state (written),
# or it waits in `canary` for live traffic. The work is idempotent when re-entered (see the
# module docstring), so a crash anywhere resumes at the state last written.


def _pending(c: _Cycle) -> CycleState:
    c.timed("repair", lambda: withdraw_orphan_canary(c.deps.registry))
    return S.REWARDING


def _rewarding(c: _Cycle) -> CycleState:
    c.enter(S.REWARDING)
    c.timed("reward", lambda: run_rewards(c.deps.engine, c.deps.spec))
    return S.TRAINING


def _training(c: _Cycle) -> CycleState | None:
    with tempfile.TemporaryDirectory() as tmp:
        champion = c.deps.registry.alias(CHAMPION)  # training continues from the champion's adapter
        parent = (
            c.timed("parent", lambda: Parent.from_adapter(c.deps.registry.adapter(champion, Path(tmp))))
            if champion
            else None
        )
        c.run_id = c.timed("train", lambda: _train(c, parent))
    return S.EVALUATING if c.run_id is not None else None  # None: skipped (written)


def _evaluating(c: _Cycle) -> CycleState | None:
    deps = c.deps
    c.enter(S.EVALUATING, run_id=c.run_id)
    stored = decision_for_run(deps.engine, c.run_id)  # decided before a crash: reused
    if stored is None:
        config = deps.config
        # the outcome model for the gate's fresh answers, fitted again once enough new rewards arrived
        outcome = c.timed(
            "outcome",
            lambda: refresh_outcome(
                deps.engine,
                config.outcome,
                config.train,
                deps.spec.version,
                config.state_dir,
                lambda: deps.make_tracker(f"{c.cycle_id}-outcome"),
            ),
        )
        result = c.timed(
            "evaluate",
            lambda: gate_run(
                GateJob(
                    deps.engine,
                    deps.registry,
                    deps.make_runner(Path(get_run(deps.engine, c.run_id).base_model)),
                    c.run_id,
                    deps.spec.version,
                    config.train,
                    config.gate,
                    suite=deps.suite,
                    abstention_patterns=deps.spec.guards.abstention.patterns,
                    cycle_id=c.cycle_id,
                    outcome=outcome,
                )
            ),
        )
        passed, version, reasons = result.decision.passed, result.version.version, result.decision.reasons
    else:
        passed, version, reasons = stored.passed, stored.candidate_version, stored.reasons
    if not passed:
        c.enter(S.REJECTED, candidate_version=version, promoted=0, reason="; ".join(reasons))
        return None
    nxt = S.STAGING if deps.config.rollout.share > 0 else S.PROMOTING
    c.enter(nxt, candidate_version=version)
    return nxt


def _staging(c: _Cycle) -> CycleState | None:
    version = c.row().candidate_version
    c.timed(
        "stage",
        lambda: c.deps.registry.stage(
            version, c.deps.config.rollout.share, actor="automatic", reason=f"cycle {c.cycle_id}: gate passed"
        ),
    )
    c.enter(S.CANARY)
    return None  # live traffic decides, at a later run


def _canary(c: _Cycle) -> CycleState | None:
    deps, row = c.deps, c.row()
    version = row.candidate_version
    try:
        verdict = c.timed(
            "online",
            lambda: online_decision(
                CanaryJob(
                    deps.engine,
                    deps.registry,
                    deps.config.rollout,
                    deps.spec.version,
                    deps.spec.ripeness.window_s,
                    c.cycle_id,
                    version,
                    row.started_at,
                    reward_window=lambda since: run_rewards(deps.engine, deps.spec, served_since=since),
                )
            ),
        )
        if verdict.decided and not verdict.passed:
            c.timed(
                "withdraw",
                lambda: deps.registry.withdraw_canary(version, "automatic", f"canary rejected online: {verdict.why}"),
            )
    except Exception as exc:  # noqa: BLE001 - the canary keeps serving; failing here would orphan it
        log.warning(
            "canary check failed; retried at the next check",
            extra={"cycle": c.cycle_id, "error": f"{type(exc).__name__}: {exc}"},
        )
        c.enter(S.CANARY, reason=f"last check failed: {type(exc).__name__}: {exc}"[:2000])
        return None
    if not verdict.decided:
        # still measuring: the test's progress is the cycle's reason (`rtrl status` shows it; the
        # row's updated_at says when it was last checked)
        c.enter(S.CANARY, reason=verdict.why)
        return None
    passed, why = verdict.passed, verdict.why
    if not passed:
        c.enter(S.REJECTED, promoted=0, reason=why)
        return None
    c.enter(S.PROMOTING, reason=why)  # the online comparison's numbers stay on the cycle
    return S.PROMOTING


def _promoting(c: _Cycle) -> CycleState | None:
    deps = c.deps
    version = c.row().candidate_version
    passed_what = "gate and canary passed" if deps.config.rollout.share > 0 else "gate passed"
    # decided against the champion of then: an operator's rollback or promotion meanwhile wins
    decided = latest_decision(deps.engine, deps.registry.name, version)
    try:
        c.timed(
            "promote",
            lambda: deps.registry.promote(
                version,
                actor="automatic",
                reason=f"cycle {c.cycle_id}: {passed_what}",
                against=decided.champion_version if decided is not None else ANY,
            ),
        )
    except Superseded as exc:
        c.enter(S.REJECTED, promoted=0, reason=f"not promoted: {exc}")
        return None
    c.enter(S.DONE, promoted=1)
    return None


HANDLERS: dict[CycleState, Callable[[_Cycle], CycleState | None]] = {
    S.PENDING: _pending,
    S.REWARDING: _rewarding,
    S.TRAINING: _training,
    S.EVALUATING: _evaluating,
    S.STAGING: _staging,
    S.CANARY: _canary,
    S.PROMOTING: _promoting,
}


def run_cycle(deps: CycleDeps) -> CycleRecord | None:
    """Run one cycle, or finish the one a crash interrupted; returns its row (None if the lease
    was lost: the row is the new holder's). Never raises for a failing stage: the cycle ends
    `failed` with the reason; a lost lease stops it where it is, for the new holder to resume."""
    deps.registry.fence = deps.fence
    row = unfinished_cycle(deps.engine)
    if row is None and deps.stopping is not None and deps.stopping.is_set():
        return None  # shutting down: no new cycle, to be stopped before its first stage
    if row is None:
        cycle_id = f"c-{uuid.uuid4().hex[:12]}"
        try:
            create_cycle(deps.engine, cycle_id, deps.owner, fence=deps.fence)
        except LeaseLost as exc:
            log.warning("cycle not started: the lease is lost", extra={"error": str(exc)})
            return None
        row = get_cycle(deps.engine, cycle_id)
        if row is None:  # committed just above: a store that does not return it is broken
            raise LookupError(f"cycle {cycle_id} was created but cannot be read back")
    elif row.state != S.CANARY:  # a canary waiting on traffic is not an interruption
        log.info("resuming an interrupted cycle", extra={"cycle": row.cycle_id, "state": row.state})
    c = _Cycle(deps, row)
    try:
        # an alias move a crash interrupted (its audit row completed), a model-update event the
        # broker was not there for (sent): whatever this cycle then does, serving learns the champion
        c.timed("repair", deps.registry.repair)
        state: CycleState | None = CycleState(row.state)
        while state is not None:
            state = HANDLERS[state](c)
    except LeaseLost as exc:  # another daemon holds the lease now: it resumes this cycle; write nothing
        log.warning("cycle stopped: the lease was lost", extra={"cycle": c.cycle_id, "error": str(exc)})
        return None
    except Stopping as exc:  # the state written last is where the next start resumes; write nothing
        log.warning(
            "cycle stopped: the daemon is shutting down; it resumes at the next start",
            extra={"cycle": c.cycle_id, "where": str(exc)},
        )
        return None
    except Exception as exc:  # noqa: BLE001 - the daemon outlives a failed cycle
        log.exception("cycle failed", extra={"cycle": c.cycle_id})
        try:
            c.enter(S.FAILED, reason=f"{type(exc).__name__}: {exc}")
        except LeaseLost:
            log.warning("cycle failure not recorded: the lease was lost", extra={"cycle": c.cycle_id})
    finally:
        total = time.perf_counter() - c.started
        if total > deps.config.cycle.sla_s:
            log.warning(
                "cycle exceeded its SLA",
                extra={"cycle": c.cycle_id, "seconds": round(total, 1), "sla_s": deps.config.cycle.sla_s},
            )
    return c.row()


def _train(c: _Cycle, parent: Parent | None) -> str | None:
    """The cycle's finished training run id, training if needed; None when the cycle is skipped."""
    deps = c.deps
    if c.run_id is not None:
        run = get_run(deps.engine, c.run_id)
        if run is not None and run.status == "finished":
            return c.run_id
        if run is not None and run.status == "running":  # the process died mid-training
            finish_run(deps.engine, c.run_id, "failed", error=f"abandoned: cycle {c.cycle_id} was interrupted")
    cfg, runs_dir = deps.config.train, deps.config.state_dir / "runs"
    selection = select(deps.engine, cfg, deps.spec.version, parent)
    new, since = unseen_episodes(deps.engine, deps.spec.version, selection)
    if new < deps.config.cycle.min_new_episodes:
        c.enter(
            S.SKIPPED,
            reason=f"{new} new rewarded episodes{since}, fewer than cycle.min_new_episodes "
            f"({deps.config.cycle.min_new_episodes})",
        )
        return None
    run_id = uuid.uuid4().hex
    c.enter(S.TRAINING, run_id=run_id)  # recorded first: a crash mid-training is found on resume
    tracker = deps.make_tracker(c.cycle_id)
    tracker.set_tags({"rtrl.cycle": c.cycle_id})
    try:
        run_training(
            TrainJob(
                deps.engine,
                cfg,
                deps.spec.version,
                runs_dir,
                tracker,
                parent,
                params={"cycle": c.cycle_id},
                run_id=run_id,
                selection=selection,
                on_step=_step_check(deps),
            )
        )
    except NothingToTrain as exc:
        tracker.end("KILLED")
        c.enter(S.SKIPPED, reason=str(exc))
        return None
    return run_id


def _step_check(deps: CycleDeps, every_s: float = 1.0) -> Callable[..., None] | None:
    """A training step callback that stops a run whose daemon is shutting down (at once) or lost
    the lease (at most one store read a second, and always at the last step, before the run is
    recorded finished): a run can last hours, and the new holder is training the cycle again."""
    if deps.fence is None and deps.stopping is None:
        return None
    last = [time.monotonic()]

    def check(step: int, total: int, *_: Any) -> None:
        if deps.stopping is not None and deps.stopping.is_set():
            raise Stopping(f"at training step {step} of {total}")
        if deps.fence is not None and (step >= total or time.monotonic() - last[0] >= every_s):
            last[0] = time.monotonic()
            with deps.engine.connect() as conn:
                deps.fence.check(conn)

    return check
