"""The reward stage: rewards of every ripe episode under a spec (reward/scoring.py scores; a large
store is split over processes by reward/parallel.py), orphaned feedback counted, and one
episode's reward explained.

A run is incremental: the spec's progress row (tables.reward_progress) says below which
interaction id every episode is settled -- rewarded, ripe, its reward counting all its inputs --
and up to which feedback id the feedback was read. A run reads the ids after the settled ones,
and of the settled ones only those that new feedback (or a new call in their agent episode)
names; it reports the others from the counts kept in the row. A run with nothing new then costs
a few index probes at any history size (docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from sqlalchemy import Engine

from pipeline.core.store.episode_reads import iter_episode_chunks
from pipeline.core.store.events import utcnow
from pipeline.core.store.reward_progress import (
    RewardProgress,
    episode_counts,
    first_interaction_id,
    load_progress,
    revisit_ids,
    save_progress,
)
from pipeline.core.store.rewards import episode_request_ids, orphaned_feedback
from pipeline.core.store.watermarks import safe_tops
from reward.compute import compute_reward, is_ripe
from reward.judge import Judge
from reward.parallel import auto_workers, score_in_parallel
from reward.scoring import PAYLOAD_KINDS, RewardRunReport, Settling, build_episode, judge_scores, score_part
from reward.spec import RewardSpec

__all__ = [
    "PAYLOAD_KINDS",
    "RewardRunReport",
    "build_episode",
    "explain",
    "explain_episode",
    "run_rewards",
    "score_part",
]


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
    the run over that many processes, 0 picks a number for what there is to read (see
    reward/parallel.py); a spec with a judge runs in one, since its budget and model are
    per run. `served_since`: only episodes served from then on (a canary's check reads its
    own window, at a cost that does not grow with the history; orphans are counted over
    feedback from then on).

    A rule-based spec's run is incremental (see _incremental); a judge's runs and windowed
    runs read their whole range, as does a run on PostgreSQL that cannot have safe_tops."""
    now = now or utcnow()
    report = RewardRunReport(spec_version=spec.version, recomputed=force)
    tops = safe_tops(engine) if served_since is None and spec.judge is None else None
    orphan_before = now - timedelta(seconds=spec.join.orphan_ttl_s)
    if tops is None:
        _score(engine, spec, now, force, workers, report, on_progress, chunk, served_since=served_since)
        report.orphaned = orphaned_feedback(engine, orphan_before, since=served_since)
    else:
        report.orphaned = _incremental(
            engine, spec, now, force, workers, report, on_progress, chunk, tops, orphan_before
        )
    return report


def _incremental(
    engine: Engine,
    spec: RewardSpec,
    now: datetime,
    force: bool,
    workers: int,
    report: RewardRunReport,
    on_progress: Callable[[RewardRunReport], None] | None,
    chunk: int,
    tops: tuple[int, int],
    orphan_before: datetime,
) -> int:
    """A run that reads what changed since the spec's last run (tables.reward_progress), and
    reports the rest from the counts kept there: what a full run would report, at a cost that
    follows what is new, not the history. Its steps, in order:

        1. read again the settled episodes that changed (revisit_ids: named by new feedback, or
           an agent episode that gained a call)
        2. read the unsettled ids, [settled_below, the safe top]: new interactions and those
           that were not ripe yet (only the stale ones in full, as ever)
        3. count the settled episodes not read, from the progress row
        4. settle up to the first episode read unripe, and save the progress with the waiting
           feedback, which gives the orphan count returned -- last: a run that fails before it
           leaves the progress as it was, and the next run does the same again (the rewards it
           stored are up to date by then, and cost only their staleness check)
    """
    top_interaction, top_feedback = tops
    done = RewardProgress() if force else load_progress(engine, spec.version)
    revisit = revisit_ids(engine, done, top_interaction, top_feedback)
    again, seen = Settling(), Settling()
    score_part(engine, spec, now, force, report, on_progress, chunk_size=chunk, ids=revisit, settling=again)  # 1
    span = (done.settled_below or first_interaction_id(engine), top_interaction)  # a first run: the chunks as ever
    _score(engine, spec, now, force, workers, report, on_progress, chunk, span=span, settling=seen)  # 2
    # 3: every settled episode not read is up to date, but for those whose feedback cannot be read;
    # a re-read one that could not be read before was counted in done.unusable, and now by step 1
    was_unusable = sum(not had_reward for _, had_reward in again.unusable)
    not_read = done.episodes - len(revisit)
    report.episodes += not_read
    report.unusable += done.unusable - was_unusable
    report.unchanged += not_read - (done.unusable - was_unusable)
    report.duplicate_interactions += done.duplicates
    # 4
    settled = max(done.settled_below, min((i for i, _ in seen.unripe), default=top_interaction + 1))
    episodes, duplicates = done.episodes, done.duplicates
    for lo, hi, n_episodes, n_duplicates in seen.chunks:  # ids (lo, hi]
        if hi < settled:
            episodes, duplicates = episodes + n_episodes, duplicates + n_duplicates
        elif lo + 1 < settled:  # the chunk the first unripe episode is in: count its settled part
            more, more_duplicates = episode_counts(engine, lo + 1, settled)
            episodes, duplicates = episodes + more, duplicates + more_duplicates
    unusable = done.unusable + len(again.unusable) - was_unusable + sum(i < settled for i, _ in seen.unusable)
    # a settled episode read unripe (an agent episode's new call, a run with an earlier `now`)
    # is read again next run, since nothing else would name it
    pending = sorted({request_id for _, request_id in again.unripe})
    after = RewardProgress(settled, top_feedback, episodes, duplicates, unusable, pending)
    return save_progress(engine, spec.version, done, after, orphan_before)


def _score(
    engine: Engine,
    spec: RewardSpec,
    now: datetime,
    force: bool,
    workers: int,
    report: RewardRunReport,
    on_progress: Callable[[RewardRunReport], None] | None,
    chunk: int,
    served_since: datetime | None = None,
    span: tuple[int, int] | None = None,
    settling: Settling | None = None,
) -> None:
    """The episodes of `span` (else of the whole store, or from `served_since`), in one process
    or split over `workers`."""
    if workers == 0 and spec.judge is None:
        workers = auto_workers(engine, span)
    if workers > 1 and spec.judge is None:
        score_in_parallel(engine, spec, now, force, workers, report, on_progress, chunk, served_since, span, settling)
    else:
        score_part(
            engine,
            spec,
            now,
            force,
            report,
            on_progress,
            chunk_size=chunk,
            served_since=served_since,
            span=span,
            settling=settling,
        )


def explain(engine: Engine, spec: RewardSpec, request_id: str, now: datetime | None = None):
    """(episode, result, ripe) for one request, computed now under `spec`; None if unknown."""
    found = _explain(engine, spec, [request_id], now)
    return found[0] if found else None


def explain_episode(
    engine: Engine, spec: RewardSpec, episode_id: str, now: datetime | None = None, tenant: str | None = None
):
    """(call, result, ripe) for each call of tenant `tenant`'s agent episode (None: the tenant that
    has one of that id), first call first, computed now under `spec` (each result shows the
    call's credited share of the outcome); [] if unknown."""
    calls = _explain(engine, spec, episode_request_ids(engine, episode_id, tenant), now)
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
