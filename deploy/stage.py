"""The deploy stage: register a trained adapter, evaluate it against the champion, gate it, and
(when asked) promote it.

    register    new model version from the run's adapter artifact, alias `candidate`
    evaluate    candidate vs champion (or the base model on first deployment) on the held-out
                slice, the regression suite, canaries, KL, smoke (deploy/evaluate.py)
    decide      deploy/gate.py; the decision and every number go to the store and the version's tags
    promote     only on a passing decision (automatic), else the candidate stays a candidate

With a staged rollout, a candidate that passed serves a share of live traffic as the canary;
`online_decision` looks at the sequential test on what each side served (deploy/rollout.py) and
records its decision beside the gate's once it meets a boundary.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Engine

from deploy import rollout
from deploy.evaluate import EvalJob, Evaluation, Runner, evaluate
from deploy.fresh import OutcomeScorer
from deploy.gate import Decision, decide
from deploy.registry import CANARY, CHAMPION, Registry, RegistryError, Version
from deploy.sequential import CONTINUE, Design
from deploy.suite import EMPTY, Suite
from pipeline.core.config import GateConfig, RolloutConfig, TrainConfig, duration_s
from pipeline.core.faults import pause_point
from pipeline.core.store.deploys import last_move_to, latest_decision
from pipeline.core.store.events import utcnow
from pipeline.core.store.online import online_units, tool_call_errors
from pipeline.core.store.training import get_run, select_eval_episodes
from pipeline.core.timing import Stopwatch
from pipeline.core.types import LoggedEpisode, sampling_params

log = logging.getLogger("rtrl.deploy")


@dataclass
class GateResult:
    version: Version
    champion: Version | None
    decision: Decision
    evaluation: Evaluation
    promoted: bool
    seconds: dict[str, float]  # registry, load, select, generate, log_probs, estimate


def adapter_name(version: Version | None) -> str | None:
    """The runner's name for a registry version's adapter (None: the base model)."""
    return None if version is None else f"v{version.version}-{(version.run_id or 'local')[:12]}"


def logged_episode(request_id: str, body: str, reward: float) -> LoggedEpisode:
    """A served interaction (its stored event body) and its reward, as evaluation reads it;
    ValueError if the body is not usable (not JSON, a sampling temperature that is no number)."""
    ev = orjson.loads(body)
    if ev.get("truncated"):
        raise ValueError("a truncated stream: the client saw less than was generated")
    sampling = sampling_params(ev.get("sampling"))
    return LoggedEpisode(
        request_id,
        ev.get("prompt", ""),
        ev.get("completion", ""),
        ev.get("completion_token_ids"),
        ev.get("behavior_logprobs"),
        sampling.temperature,
        float(reward),
        sampling.top_p,
        sampling.top_k,
        ev.get("tools"),
    )


def eval_episodes(
    engine: Engine, spec_version: str, train: TrainConfig, gate: GateConfig
) -> tuple[list[LoggedEpisode], dict[str, int]]:
    """The held-out episodes to evaluate on, and how many were unusable (skipped, by reason)."""
    served_after = utcnow() - timedelta(seconds=train.staleness_s) if train.staleness_s else None
    rows = select_eval_episodes(engine, spec_version, train.holdout_percent, gate.eval_episodes, served_after)
    out, unusable = [], {"unusable_events": 0}
    for row in rows:
        try:
            out.append(logged_episode(row.request_id, row.body, row.reward))
        except ValueError:  # orjson's decode error is one too
            unusable["unusable_events"] += 1
    return out, unusable


@dataclass(frozen=True)
class GateJob:
    """One gate (gate_run) of one training run's adapter, as the cycle's dependencies or `rtrl gate`
    build it."""

    engine: Engine
    registry: Registry  # callers run registry.repair() first (the cycle as it starts, the CLI as it opens it)
    runner: Runner  # the policies, the candidate's adapter loaded into it next to the champion's
    run_id: str  # a finished training run
    spec_version: str  # the reward spec whose rewards the held-out episodes carry
    train: TrainConfig  # its hold-out slice, staleness and max_seq_len
    gate: GateConfig
    suite: Suite = EMPTY
    abstention_patterns: tuple[str, ...] = ()
    promote: bool = False  # move the champion to the candidate if it passes (no staged rollout)
    cycle_id: str | None = None  # tagged on the version
    # per policy version, from the reward stage's audit: kept with the decision
    production_canaries: dict[str, dict[str, float]] | None = None
    outcome: OutcomeScorer | None = None  # the outcome model of the fresh-answer estimates (None: none yet)


def gate_run(job: GateJob) -> GateResult:
    """Register, evaluate and gate the adapter of training run `job.run_id`; the decision stored
    with every number and tagged on the model version."""
    engine, registry, runner, run_id = job.engine, job.registry, job.runner, job.run_id
    train, gate = job.train, job.gate
    watch = Stopwatch()  # where the seconds went: kept with the decision
    run = get_run(engine, run_id)
    if run is None or run.status != "finished":
        raise RegistryError(
            f"training run {run_id} is {'unknown' if run is None else run.status}: "
            "gate a finished run (`rtrl train show` lists the latest)"
        )
    if not run.tracking_run_id:
        raise RegistryError(f"training run {run_id} has no MLflow run to register the adapter from")
    with watch("registry"):
        # a crash between registering and recording the decision left a version of this run:
        # gate that one, not a second copy
        version = registry.version_of_run(run_id) or registry.register(
            run.tracking_run_id,
            {
                "rtrl.run_id": run_id,
                "base_model": run.base_model,
                "base_revision": run.base_revision,
                "spec_version": run.spec_version,
                "loss": run.loss,
                "watermark_from": run.watermark_from,
                "watermark_to": run.watermark_to,
                "episodes": run.episodes,
                "parent_run_id": run.parent_run_id or "",
                **({"rtrl.cycle": job.cycle_id} if job.cycle_id else {}),
            },
        )
        champion = registry.alias(CHAMPION)
    # adapters are named by version (and run): a runner that stays loaded between cycles (the
    # daemon's) keeps the champion, and a candidate that passes is already loaded next cycle
    champion_name, candidate_name = adapter_name(champion), adapter_name(version)
    for stale in set(runner.names) - {champion_name, candidate_name}:
        runner.remove(stale)
    with watch("load"):
        if champion is not None and champion_name not in runner.names:
            with tempfile.TemporaryDirectory() as tmp:
                runner.add(champion_name, registry.adapter(champion, Path(tmp)))
        load_error = None
        try:
            runner.add(candidate_name, Path(run.adapter_path))
        except Exception as exc:  # noqa: BLE001 - an adapter that does not load fails the smoke check
            load_error = f"{type(exc).__name__}: {exc}"
    with watch("select"):
        episodes, unusable = eval_episodes(engine, job.spec_version, train, gate)
    evaluation = evaluate(
        EvalJob(
            runner,
            candidate_name,
            champion_name,
            episodes,
            gate,
            suite=job.suite,
            abstention_patterns=job.abstention_patterns,
            generate_prompts=gate.generate_prompts,
            max_new_tokens=gate.max_new_tokens,
            load_error=load_error,
            champion_label=f"v{champion.version}" if champion else "base",
            watch=watch,
            max_seq_len=train.max_seq_len,
            outcome=job.outcome,
        )
    )
    evaluation.excluded.update(unusable)
    if champion is None and gate.first_deployment == "base":
        # first deployment: the base model, which served until now, is the champion to beat
        decision = decide(evaluation.candidate, evaluation.champion, evaluation.comparison, gate, first=True)
    elif champion is None:  # "absolute" limits only, or "refuse"
        decision = decide(evaluation.candidate, None, None, gate)
    else:
        decision = decide(evaluation.candidate, evaluation.champion, evaluation.comparison, gate)
    report: dict[str, Any] = {
        "evaluation": evaluation.to_dict(),
        "suite": job.suite.version,
        "production_canaries": job.production_canaries or {},
        "seconds": watch.parts,
        "outcome_model": None
        if job.outcome is None
        else {
            "usable": job.outcome.usable,
            "why": job.outcome.why,
            "path": getattr(job.outcome, "manifest", {}).get("path"),
        },
    }
    with watch("registry"):  # (the decision's own write is not in its report's seconds)
        registry.record_decision(version.version, champion.version if champion else None, run_id, decision, report)
    if not decision.passed and load_error is None:
        runner.remove(candidate_name)  # it will not serve: do not keep it loaded
    promoted = False
    if job.promote and decision.passed:
        promoted = registry.promote(version.version, actor="automatic", reason="gate passed")
    return GateResult(version, champion, decision, evaluation, promoted, watch.parts)


class OnlineCheck(NamedTuple):
    """What a canary check found: decided (passed, and why), or still measuring (why: the
    sequential test's progress, which the cycle shows in `rtrl status`)."""

    decided: bool
    passed: bool
    why: str


@dataclass(frozen=True)
class CanaryJob:
    """One look at a canary's online test (online_decision), as the cycle builds it."""

    engine: Engine
    registry: Registry
    cfg: RolloutConfig
    spec_version: str  # whose rewards the sides are compared on
    ripeness_s: float  # the spec's ripeness window: an episode younger than this is not settled
    cycle_id: str
    version: str  # the canary's
    cycle_started: datetime  # the canary's start when the registry has no move to it
    # rewards what was served since then (the reward stage, run by the caller's orchestration)
    reward_window: Callable[[datetime], Any]


def online_decision(job: CanaryJob) -> OnlineCheck:
    """Canary `job.version`'s online test against the champion at this moment (deploy/rollout.py):
    decided once it met a boundary (or an operator decided for it), else its progress. The
    decision is recorded once; a cycle resumed after a crash reads it back."""
    engine, registry, cfg, cycle_id, version = job.engine, job.registry, job.cfg, job.cycle_id, job.version
    decision = latest_decision(engine, registry.name, version)
    if decision is not None and decision.stage == "online" and decision.cycle == cycle_id:
        return OnlineCheck(True, decision.passed, decision.summary)
    champion, canary = registry.alias(CHAMPION), registry.alias(CANARY)
    if champion is not None and champion.version == version:
        return OnlineCheck(True, True, f"version {version} was promoted by an operator during its canary")
    if canary is None or canary.version != version:
        return OnlineCheck(True, False, f"the canary (version {version}) was withdrawn by an operator")
    gated_against = decision.champion_version if decision is not None else None
    now = champion.version if champion is not None else None
    if decision is not None and gated_against != now:
        # an operator's rollback or promotion during the canary wins: the candidate was gated
        # against another champion, and its online sides would straddle the move
        return OnlineCheck(
            True,
            False,
            f"the champion moved from {gated_against or 'the base'} to "
            f"{now or 'the base'} during the canary (an operator's move): version "
            f"{version} is not promoted over it",
        )
    move = last_move_to(engine, registry.name, CANARY, version)
    # the canary went live with its move (an alias set by hand has none: the cycle's start)
    staged_at = move.at if move is not None else job.cycle_started
    # rewards for what both sides served since: only that window is read (the cycle's own reward
    # stage brings the rest of the history up to date), so a check costs the same on any store
    job.reward_window(staged_at)
    # only requests whose outcome is final (the spec's ripeness window has passed): an early
    # terminal signal would otherwise over-represent the outcomes that arrive fast
    settled = utcnow() - timedelta(seconds=job.ripeness_s)
    serving = champion.version if champion else "base"
    units = online_units(
        engine,
        job.spec_version,
        [serving, version],
        staged_at,
        until=settled,
        covariate=cfg.covariate,
        history=cfg.covariate_history,
    )
    seen = rollout.look(units.get(serving), units.get(version), cfg)
    if seen.verdict != CONTINUE:
        calls = tool_call_errors(engine, [serving, version], staged_at, until=settled)
        result = rollout.decide(seen, cfg, (calls.get(serving, (0, 0)), calls.get(version, (0, 0))))
    elif (utcnow() - staged_at).total_seconds() > duration_s(cfg.max_wait):
        result = rollout.too_little_traffic(seen, cfg)
    else:
        progress = seen.summary(Design.of(cfg))
        log.info(
            "canary still measuring",
            extra={
                "cycle": cycle_id,
                "version": version,
                "episodes": {serving: seen.n_champion, version: seen.n_canary},
                "difference": seen.difference,
                "promote_at": seen.promote_at,
                "withdraw_at": seen.withdraw_at,
                "expected_more": seen.expected_more[1],
            },
        )
        return OnlineCheck(False, False, f"canary v{version}: {progress}")
    sides = {v: dict(zip(("n", "mean", "var"), u.summary())) for v, u in units.items()}
    registry.record_online(
        version, champion.version if champion else None, cycle_id, result, {**sides, "sequential": asdict(seen)}
    )
    pause_point("canary.decided")  # crash tests kill the process here: a restart reuses the decision
    return OnlineCheck(True, result.passed, "; ".join(c.detail for c in result.checks if result.passed or not c.passed))


def withdraw_orphan_canary(registry: Registry) -> Version | None:
    """A canary alias left by a cycle that failed after staging it (its promotion failed, say)
    serves no purpose once no cycle measures it: withdrawn (returned), before a new cycle starts."""
    withdrawn = registry.unstage("automatic", "no cycle is measuring this canary (its cycle ended)")
    if withdrawn is not None:
        log.warning("withdrew a canary no cycle was measuring", extra={"version": withdrawn.version})
    return withdrawn
