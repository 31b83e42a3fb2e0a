"""The reward stage: the delayed-outcome join, incremental and idempotent.

    for each chunk of interactions (id order)            -- streamed, never all in memory
        join its feedback by request_id                   -- arrival order does not matter
        skip episodes that are not ripe yet
        skip episodes whose stored reward already reflects their newest feedback
        compute, upsert (request_id, spec version)        -- late feedback updates the reward

Feedback whose interaction has not arrived simply waits in the store and is joined when the
interaction comes; `orphaned` counts those older than the spec's orphan TTL, to be reported.
Late feedback on an episode that a training run already used updates the reward too, but the
run's lineage (training_episodes) keeps the value it trained on, and the change is counted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import orjson
from sqlalchemy import Engine

from pipeline.store.events import utcnow
from pipeline.store.rewards import (
    iter_episode_chunks,
    judge_scores_for,
    orphaned_feedback,
    store_judge_scores,
    trained_request_ids,
    upsert_rewards,
)
from reward.compute import RewardResult, compute_reward, is_ripe
from reward.judge import Judge
from reward.signals import Episode, Feedback
from reward.spec import RewardSpec

# kinds whose payload a signal reads; other feedback bodies are never parsed
_PAYLOAD_KINDS = {"edited"}


def completion_parts(completion: Any) -> tuple[str, tuple]:
    """(assistant text, tool calls) of a completion: text, or a trajectory of messages where
    only assistant turns are the policy's output."""
    if isinstance(completion, str):
        return completion, ()
    texts, calls = [], []
    for msg in completion if isinstance(completion, list) else ():
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            content = msg.get("content")
            if isinstance(content, str):
                texts.append(content)
            calls.extend(msg.get("tool_calls") or ())
    return "\n".join(texts), tuple(calls)


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    lines = [f"{m.get('role', '?')}: {m.get('content', '')}" for m in prompt if isinstance(m, dict)]
    return "\n".join(lines)


def build_episode(row: Any, feedback_rows: list[Any]) -> Episode:
    body = orjson.loads(row.body)
    text, calls = completion_parts(body.get("completion"))
    metadata = body.get("metadata") or {}
    fbs = []
    for f in feedback_rows:
        payload = orjson.loads(f.body).get("payload") if f.kind in _PAYLOAD_KINDS else None
        fbs.append(Feedback(event_id=f.event_id, kind=f.kind, value=f.value, ts=f.ts, payload=payload))
    return Episode(
        request_id=row.request_id, ts=row.ts, policy_version=row.policy_version, text=text,
        tool_calls=calls, feedback=tuple(fbs), prompt_text=prompt_text(body.get("prompt", "")),
        expects_attempt=bool(metadata.get("expects_attempt", True)) if isinstance(metadata, dict) else True,
    )


@dataclass
class RewardRunReport:
    spec_version: str
    episodes: int = 0
    computed: int = 0  # new rewards
    updated: int = 0  # rewards changed by late feedback
    unchanged: int = 0  # already up to date
    unripe: int = 0
    orphaned: int = 0
    judge_deferred: int = 0  # ripe, but over the judge budget of this run
    changed_after_training: int = 0  # updated rewards of episodes a training run already used
    duplicate_interactions: int = 0  # more than one interaction for a request_id: the first counts
    value_sum: float = 0.0
    ignored_kinds: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        n = self.computed + self.updated
        mean = f", mean {self.value_sum / n:+.3f}" if n else ""
        return (f"spec {self.spec_version}: {self.episodes} episodes; {self.computed} rewards computed, "
                f"{self.updated} updated by late feedback{mean}; {self.unchanged} up to date; "
                f"{self.unripe} not ripe yet; {self.orphaned} orphaned feedback events past the TTL"
                + (f"; {self.judge_deferred} wait for the judge budget" if self.judge_deferred else "")
                + (f"; {self.changed_after_training} changed after a training run used them"
                   if self.changed_after_training else "")
                + (f"; {self.duplicate_interactions} duplicate interactions ignored (first one counts)"
                   if self.duplicate_interactions else ""))


def run_rewards(
    engine: Engine,
    spec: RewardSpec,
    now: datetime | None = None,
    on_progress: Callable[[RewardRunReport], None] | None = None,
    force: bool = False,
) -> RewardRunReport:
    """Compute or update the rewards of every ripe episode under `spec`. With `force`,
    recompute even rewards that already reflect the newest feedback (e.g. after a change
    to a signal function, which the spec version does not capture)."""
    now = now or utcnow()
    version = spec.version
    report = RewardRunReport(spec_version=version)
    judge = Judge(spec.judge) if spec.judge else None
    budget = spec.judge.budget if spec.judge else 0
    for chunk in iter_episode_chunks(engine, version):
        todo: list[tuple[Episode, int, bool]] = []  # episode, newest feedback id, first time
        report.duplicate_interactions += chunk.duplicates
        for row in chunk.interactions:
            report.episodes += 1
            fb_rows = chunk.feedback.get(row.request_id, [])
            newest = max((f.id for f in fb_rows), default=0)
            stored = chunk.stored.get(row.request_id)
            if stored is not None and stored >= newest and not force:
                report.unchanged += 1
                continue
            ep = build_episode(row, fb_rows)
            if not is_ripe(ep, spec, now):
                report.unripe += 1
                continue
            todo.append((ep, newest, stored is None))
        scores: dict[str, float] = {}
        if judge is not None:
            scores, budget = _judge(engine, judge, [ep for ep, _, _ in todo], budget)
        # late feedback on an episode a training run already used: the run keeps the value it
        # used (training_episodes); the reward moves on, and the change is counted
        trained = trained_request_ids(engine, [ep.request_id for ep, _, first in todo if not first], version)
        out = []
        for ep, newest, first in todo:
            if judge is not None and ep.request_id not in scores:
                report.judge_deferred += 1  # over this run's judge budget: next run
                continue
            result = compute_reward(ep, spec, scores.get(ep.request_id))
            out.append(reward_row(ep, result, version, newest))
            report.computed += first
            report.updated += not first
            report.changed_after_training += ep.request_id in trained
            report.value_sum += result.value
            for kind in result.ignored_kinds:
                report.ignored_kinds[kind] = report.ignored_kinds.get(kind, 0) + 1
        upsert_rewards(engine, out)
        if on_progress:
            on_progress(report)
    report.orphaned = orphaned_feedback(engine, now - timedelta(seconds=spec.join.orphan_ttl_s))
    return report


def _judge(engine: Engine, judge: Judge, episodes: list[Episode], budget: int) -> tuple[dict[str, float], int]:
    """Cached scores, plus new ones for as many uncached episodes as the budget allows."""
    scores = judge_scores_for(engine, [ep.request_id for ep in episodes], judge.version)
    missing = [ep for ep in episodes if ep.request_id not in scores][:budget]
    if missing:
        fresh = dict(zip((ep.request_id for ep in missing), judge.score(missing)))
        store_judge_scores(engine, judge.version, fresh)
        scores.update(fresh)
    return scores, budget - len(missing)


def reward_row(ep: Episode, result: RewardResult, spec_version: str, last_feedback_id: int) -> dict[str, Any]:
    return {
        "request_id": ep.request_id,
        "spec_version": spec_version,
        "policy_version": ep.policy_version,
        "value": result.value,
        "components": result.components,
        "feedback_count": len(ep.feedback),
        "last_feedback_id": last_feedback_id,
    }


def explain(engine: Engine, spec: RewardSpec, request_id: str, now: datetime | None = None):
    """(episode, result, ripe) for one request, computed now under `spec`; None if unknown."""
    for chunk in iter_episode_chunks(engine, spec.version, request_ids=[request_id]):
        row = chunk.interactions[0]
        ep = build_episode(row, chunk.feedback.get(request_id, []))
        score = None
        if spec.judge is not None:
            scores, _ = _judge(engine, Judge(spec.judge), [ep], budget=1)
            score = scores[request_id]
        return ep, compute_reward(ep, spec, score), is_ripe(ep, spec, now or utcnow())
    return None
