"""The reward stage: rewards of every ripe episode under a spec (reward/scoring.py scores; a large
store is split over processes by reward/parallel.py), orphaned feedback counted, and one
episode's reward explained.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import Engine

from pipeline.core.store.events import utcnow
from pipeline.core.store.rewards import episode_request_ids, iter_episode_chunks, orphaned_feedback
from reward.compute import compute_reward, is_ripe
from reward.judge import Judge
from reward.parallel import auto_workers, score_in_parallel
from reward.scoring import PAYLOAD_KINDS, RewardRunReport, build_episode, judge_scores, score_part
from reward.spec import RewardSpec

__all__ = ["PAYLOAD_KINDS", "RewardRunReport", "build_episode", "explain", "explain_episode", "run_rewards",
           "score_part"]


def run_rewards(
    engine: Engine,
    spec: RewardSpec,
    now: datetime | None = None,
    on_progress: Callable[[RewardRunReport], None] | None = None,
    force: bool = False,
    workers: int = 1,
    chunk: int = 5000,
    served_since: datetime | None = None,
) -> RewardRunReport:
    """Compute or update the rewards of every ripe episode under `spec`. With `force`,
    recompute even rewards that already reflect the newest feedback (e.g. after a change
    to a signal function, which the spec version does not capture). `workers` > 1 splits
    the run over that many processes, 0 picks a number for the store's size (see
    reward/parallel.py); a spec with a judge runs in one, since its budget and model are
    per run. `served_since`: only episodes served from then on (a canary's check reads its
    own window, at a cost that does not grow with the history; orphans are counted over
    feedback from then on)."""
    now = now or utcnow()
    report = RewardRunReport(spec_version=spec.version, recomputed=force)
    if workers == 0 and spec.judge is None:
        workers = auto_workers(engine)
    if workers > 1 and spec.judge is None:
        score_in_parallel(engine, spec, now, force, workers, report, on_progress, chunk, served_since)
    else:
        score_part(engine, spec, now, force, report, on_progress, chunk_size=chunk, served_since=served_since)
    report.orphaned = orphaned_feedback(engine, now - timedelta(seconds=spec.join.orphan_ttl_s), since=served_since)
    return report


def explain(engine: Engine, spec: RewardSpec, request_id: str, now: datetime | None = None):
    """(episode, result, ripe) for one request, computed now under `spec`; None if unknown."""
    found = _explain(engine, spec, [request_id], now)
    return found[0] if found else None


def explain_episode(engine: Engine, spec: RewardSpec, episode_id: str, now: datetime | None = None):
    """(call, result, ripe) for each call of an agent episode, first call first, computed now
    under `spec` (each result shows the call's credited share of the outcome); [] if unknown."""
    calls = _explain(engine, spec, episode_request_ids(engine, episode_id), now)
    return sorted(calls, key=lambda found: -found[0].calls_after)


def _explain(engine: Engine, spec: RewardSpec, request_ids: list[str], now: datetime | None):
    if not request_ids:
        return []
    now, out = now or utcnow(), []
    judge = Judge(spec.judge) if spec.judge is not None else None
    for chunk in iter_episode_chunks(engine, spec.version, request_ids=request_ids, with_body=True):
        for row in chunk.interactions:
            ep = build_episode(row)
            score = judge_scores(engine, judge, [ep], budget=1)[0][ep.request_id] if judge is not None else None
            out.append((ep, compute_reward(ep, spec, score), is_ripe(ep, spec, now)))
    return out
