"""Scoring a part of the store's episodes: the delayed-outcome join, incremental and idempotent.

    for each chunk of interactions (id order)            -- streamed, never all in memory
        join its feedback by request_id                   -- arrival order does not matter
        skip episodes that are not ripe yet
        skip episodes whose stored reward already reflects their newest feedback
        compute, upsert (request_id, spec version)        -- late feedback updates the reward

Feedback whose interaction has not arrived simply waits in the store and is joined when the
interaction comes; `orphaned` counts those older than the spec's orphan TTL, to be reported.
Late feedback on an episode that a training run already used updates the reward too, but the
run's lineage (training_episodes) keeps the value it trained on, and the change is counted.

Throughput (benchmarks/reward.py): an episode comes back as one row, its feedback aggregated
into a JSON array by the database and what the policy wrote from the columns ingest filled (the
body, mostly prompt, is read only for a judge); rows come as named tuples, a Scorer holds the
spec's lookups, rewards are upserted through the driver, and the cyclic garbage collector is
paused while chunks are scored (a chunk allocates ~100k short-lived objects and no cycles; the
collector's passes over them were a third of the run). A chunk's upsert runs on a writer
thread while the next chunk is read and scored: the database drivers release the GIL while
the database works, and in a run split over workers a write that waits for another worker's
SQLite lock no longer idles its core (SQLite's busy handler sleeps in steps of 1-100 ms).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import Engine

from pipeline.core.store import db as store_db
from pipeline.core.store.episode_reads import EpisodeRow, episode_rows, feedback_rows, iter_episode_chunks
from pipeline.core.store.rewards import (
    RewardRow,
    judge_scores_for,
    store_judge_scores,
    trained_request_ids,
    upsert_rewards,
)
from reward.compute import Scorer
from reward.judge import Judge
from reward.signals import Episode, Feedback
from reward.spec import RewardSpec

# kinds whose payload a signal reads; other feedback bodies are never parsed
PAYLOAD_KINDS = ("edited",)


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    lines = [f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict)]
    return "\n".join(lines)


def read_episode(row: EpisodeRow) -> tuple[int, Episode]:
    """A chunk's row (see iter_episode_chunks) as (the newest feedback id it reflects, 0 when
    none; the episode). The prompt is rendered only when the row has the body (a judge reads
    it; rules never do)."""
    newest, feedback = feedback_rows(row)
    ts = datetime.fromisoformat(row.ts) if isinstance(row.ts, str) else row.ts  # SQLite's text
    prompt = prompt_text(orjson.loads(row.body).get("prompt", "")) if row.body is not None else ""
    calls = row.output_tool_calls
    episode = Episode(
        row.request_id,
        ts,
        row.policy_version,
        row.output_text,
        tuple(orjson.loads(calls)) if calls else (),
        _feedback(feedback),
        bool(row.expects_attempt),
        prompt,
    )
    in_episode = episode_rows(row)
    if row.episode_id is None or in_episode is None:
        return newest, episode
    outcome_newest, outcome, episode_calls = in_episode
    return max(newest, outcome_newest), _in_episode(episode, row.episode_id, outcome, episode_calls)


def build_episode(row: EpisodeRow) -> Episode:
    return read_episode(row)[1]


def _feedback(events: list[list[Any]]) -> tuple[Feedback, ...]:
    return tuple(
        [
            Feedback(
                event_id,
                kind,
                float(value),
                datetime.fromisoformat(fts),
                orjson.loads(fbody).get("payload") if fbody is not None and kind in PAYLOAD_KINDS else None,
            )
            for _, event_id, kind, value, fts, fbody in events
        ]
    )


def _in_episode(call: Episode, episode_id: str, outcome: list[list[Any]], calls: list[list[Any]]) -> Episode:
    """A call with its agent episode: the outcome, and its place among the episode's calls --
    ordered by the producer's `step`, a call without one after those with one, then by the time
    they were served, then by request id: a total order whatever the arrival order, so exactly
    one call is the last (the store orders an episode's first call the same way). A comparison
    by step only where both calls have one is no order: with steps on some calls and not others
    it can go round in a cycle, leaving no call last and, under discounted credit, none
    undiscounted."""

    def order(rid: str, step: int | None, ts: datetime) -> tuple:
        return (step if step is not None else 1 << 30, ts, rid)

    served = [(rid, step, datetime.fromisoformat(cts)) for rid, step, cts in calls]
    own = next((order(*c) for c in served if c[0] == call.request_id), order(call.request_id, None, call.ts))
    return call._replace(
        episode_id=episode_id,
        outcome=_feedback(outcome),
        calls_after=sum(order(*c) > own for c in served if c[0] != call.request_id),
        episode_calls=len(served),
        last_call_ts=max(cts for _, _, cts in served),
    )


def inputs_counted(ep: Episode) -> int:
    """What a call's stored reward reflects, counted as iter_episode_chunks counts it for
    staleness: its feedback, and for a call of an agent episode its episode's outcome and calls."""
    return len(ep.feedback) + (len(ep.outcome) + ep.episode_calls if ep.episode_id is not None else 0)


@dataclass
class RewardRunReport:
    spec_version: str
    recomputed: bool = False  # a forced run: `updated` are rewards scored again, not late feedback
    episodes: int = 0
    computed: int = 0  # new rewards
    updated: int = 0  # rewards changed by late feedback
    unchanged: int = 0  # already up to date
    unripe: int = 0
    orphaned: int = 0
    judge_deferred: int = 0  # ripe, but over the judge budget of this run
    changed_after_training: int = 0  # updated rewards of episodes a training run already used
    duplicate_interactions: int = 0  # more than one interaction for a request_id: the first counts
    unusable: int = 0  # stored episodes whose feedback could not be read (stored before the contract refused it)
    # agent episodes that ripened by their window without an outcome (each counted once: when
    # its last call is first rewarded) -- an application that never reports, or a lost outcome
    unfinished_episodes: int = 0
    value_sum: float = 0.0
    ignored_kinds: dict[str, int] = field(default_factory=dict)

    def add(self, other: RewardRunReport) -> None:
        """Count another part of the same run (a worker's) into this report."""
        for name in (
            "episodes",
            "computed",
            "updated",
            "unchanged",
            "unripe",
            "judge_deferred",
            "changed_after_training",
            "duplicate_interactions",
            "unusable",
            "unfinished_episodes",
            "value_sum",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for kind, n in other.ignored_kinds.items():
            self.ignored_kinds[kind] = self.ignored_kinds.get(kind, 0) + n

    def summary(self) -> str:
        n = self.computed + self.updated
        mean = f", mean {self.value_sum / n:+.3f}" if n else ""
        return (
            f"spec {self.spec_version}: {self.episodes} episodes; {self.computed} rewards computed, "
            f"{self.updated} {'scored again' if self.recomputed else 'updated by late feedback'}{mean}; "
            f"{self.unchanged} up to date; "
            f"{self.unripe} not ripe yet; {self.orphaned} orphaned feedback events past the TTL"
            + (f"; {self.judge_deferred} wait for the judge budget" if self.judge_deferred else "")
            + (
                f"; {self.changed_after_training} changed after a training run used them"
                if self.changed_after_training
                else ""
            )
            + (
                f"; {self.duplicate_interactions} duplicate interactions ignored (first one counts)"
                if self.duplicate_interactions
                else ""
            )
            + (f"; {self.unusable} episodes skipped: their feedback could not be read" if self.unusable else "")
            + (
                f"; {self.unfinished_episodes} agent episodes ended by their window without an outcome"
                if self.unfinished_episodes
                else ""
            )
        )


@dataclass
class Settling:
    """What an incremental run's parts saw, for reward/stage.py to advance the spec's progress
    (see tables.reward_progress): the episodes read unripe, those whose feedback could not be
    read, and each range chunk's counts."""

    unripe: list[tuple[int, str]] = field(default_factory=list)  # (interaction id, request id)
    unusable: list[tuple[int, bool]] = field(default_factory=list)  # (interaction id, had a stored reward)
    chunks: list[tuple[int, int, int, int]] = field(
        default_factory=list
    )  # (lo, hi, episodes, duplicates): ids (lo, hi]

    def add(self, other: Settling) -> None:
        self.unripe += other.unripe
        self.unusable += other.unusable
        self.chunks += other.chunks


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside: reference counting still frees everything acyclic."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def score_part(
    engine: Engine,
    spec: RewardSpec,
    now: datetime,
    force: bool,
    report: RewardRunReport,
    on_progress: Callable[[RewardRunReport], None] | None = None,
    part: tuple[int, int] = (0, 1),
    chunk_size: int = 5000,
    served_since: datetime | None = None,
    span: tuple[int, int] | None = None,
    ids: list[int] | None = None,
    settling: Settling | None = None,
) -> RewardRunReport:
    """The chunks of `part` (k of n, see iter_episode_chunks; `span` and `ids` choose what they
    cover), counted into `report`, and what an incremental run needs into `settling`. The two
    loops over a chunk's episodes are the stage's hot path: they count in locals, and the
    report takes the counts once per chunk."""
    version = spec.version
    judge = Judge(spec.judge) if spec.judge else None
    budget = spec.judge.budget if spec.judge else 0
    score = Scorer(spec)
    ripe = score.ripeness(now)
    pending: tuple[Future, RewardRunReport] | None = None  # the previous chunk's upsert and its counts

    def settle() -> None:
        """Wait for the previous chunk's upsert (raising its error), then count it: the report
        only ever counts rewards that are in the store."""
        nonlocal pending
        if pending is not None:
            written, counts = pending
            written.result()
            pending = None
            report.add(counts)
            if on_progress:
                on_progress(report)

    with gc_paused(), ThreadPoolExecutor(1, thread_name_prefix="reward-writer") as writer:
        # an in-memory store is one database per connection: another thread would see another
        submit = _at_once if store_db.in_memory(engine.url) else writer.submit
        for chunk in iter_episode_chunks(
            engine,
            version,
            chunk_size,
            payload_kinds=PAYLOAD_KINDS,
            part=part,
            only_stale=not force,
            served_since=served_since,
            with_body=judge is not None,
            span=span,
            ids=ids,
        ):
            if settling is not None and chunk.span is not None:
                settling.chunks.append((*chunk.span, len(chunk.interactions) + chunk.current, chunk.duplicates))
            report.duplicate_interactions += chunk.duplicates
            report.episodes += len(chunk.interactions) + chunk.current
            report.unchanged += chunk.current  # up to date: counted, never read
            todo: list[tuple[Episode, int, bool]] = []  # episode, newest feedback id, first time
            unusable = 0
            for row in chunk.interactions:
                try:
                    newest, ep = read_episode(row)
                except (ValueError, TypeError):  # orjson's decode error is a ValueError: one episode, not the run
                    unusable += 1
                    if settling is not None:
                        settling.unusable.append((row.id, row.stored is not None))
                    continue
                if ripe(ep):  # no stored reward yet: its first time
                    todo.append((ep, newest, row.stored is None))
                elif settling is not None:
                    settling.unripe.append((row.id, row.request_id))
            report.unusable += unusable
            report.unripe += len(chunk.interactions) - unusable - len(todo)
            scores: dict[str, float] = {}
            if judge is not None:
                scores, budget = judge_scores(engine, judge, [ep for ep, _, _ in todo], budget)
            # late feedback on an episode a training run already used: the run keeps the value it
            # used (training_episodes); the reward moves on, and the change is counted
            trained = trained_request_ids(engine, [ep.request_id for ep, _, first in todo if not first], version)
            out: list[RewardRow] = []
            first_times, value_sum, unfinished = 0, 0.0, 0
            for ep, newest, first in todo:
                if judge is not None and ep.request_id not in scores:
                    report.judge_deferred += 1  # over this run's judge budget: next run
                    continue
                result = score(ep, scores.get(ep.request_id))
                out.append(
                    RewardRow(
                        ep.request_id,
                        ep.policy_version,
                        result.value,
                        result.components,
                        inputs_counted(ep),
                        newest,
                        None
                        if ep.episode_id is None
                        else {
                            "episode_id": ep.episode_id,
                            "credit": score.credit(ep),
                            "events": [fb.event_id for fb in ep.outcome],
                        },
                    )
                )
                if first and ep.episode_id is not None and not ep.calls_after and not score.finished(ep):
                    unfinished += 1  # ripe by its window alone, reported once: its last call's first reward
                first_times += first
                value_sum += result.value
                for kind in result.ignored_kinds:
                    report.ignored_kinds[kind] = report.ignored_kinds.get(kind, 0) + 1
            settle()  # at most one chunk in flight: memory stays bounded
            pending = (
                submit(upsert_rewards, engine, version, out),
                RewardRunReport(
                    version,
                    computed=first_times,
                    updated=len(out) - first_times,
                    value_sum=value_sum,
                    unfinished_episodes=unfinished,
                    changed_after_training=sum(r.request_id in trained for r in out) if trained else 0,
                ),
            )
        settle()
    return report


def _at_once(fn: Callable[..., Any], *args: Any) -> Future:
    """fn(*args) on this thread, as a finished Future (ThreadPoolExecutor.submit's contract)."""
    done: Future = Future()
    done.set_result(fn(*args))
    return done


def judge_scores(engine: Engine, judge: Judge, episodes: list[Episode], budget: int) -> tuple[dict[str, float], int]:
    """Cached scores, plus new ones for as many uncached episodes as the budget allows."""
    scores = judge_scores_for(engine, [ep.request_id for ep in episodes], judge.version)
    missing = [ep for ep in episodes if ep.request_id not in scores][:budget]
    if missing:
        fresh = dict(zip((ep.request_id for ep in missing), judge.score(missing)))
        store_judge_scores(engine, judge.version, fresh)
        scores.update(fresh)
    return scores, budget - len(missing)
