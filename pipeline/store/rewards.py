"""Queries of the reward stage: episodes (interactions + their feedback) streamed in id order,
the rewards already stored, upserts, and orphaned feedback.

Set-based and streamed: each chunk of interactions costs three queries (interactions, their
feedback, their stored rewards), whatever the size of the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, and_, func, select
from sqlalchemy.dialects import postgresql, sqlite

from pipeline.store.events import insert_ignore, iter_id_chunks, utcnow
from pipeline.store.tables import feedback, interactions, judge_scores, rewards, training_episodes


@dataclass
class EpisodeChunk:
    interactions: list[Any]  # rows: id, request_id, ts, policy_version, body
    feedback: dict[str, list[Any]]  # request_id -> rows: id, event_id, kind, value, ts, body
    stored: dict[str, int]  # request_id -> last_feedback_id of its stored reward (this spec)
    duplicates: int = 0  # further interactions for a request_id: only the first one is an episode


def iter_episode_chunks(
    engine: Engine, spec_version: str, chunk: int = 2000, request_ids: Sequence[str] | None = None
) -> Iterator[EpisodeChunk]:
    """All interactions (or those of `request_ids`) with their feedback, in id order."""
    stmt = select(interactions.c.id, interactions.c.request_id, interactions.c.ts,
                  interactions.c.policy_version, interactions.c.body)
    if request_ids is not None:
        stmt = stmt.where(interactions.c.request_id.in_(list(request_ids)))
    for rows in iter_id_chunks(engine, stmt, interactions.c.id, chunk):
        ids = list({r.request_id for r in rows})
        with engine.connect() as conn:
            # a request is one episode: its first interaction (a producer that sent two is buggy)
            first = dict(conn.execute(
                select(interactions.c.request_id, func.min(interactions.c.id))
                .where(interactions.c.request_id.in_(ids)).group_by(interactions.c.request_id)
            ).all())
            fb_rows = conn.execute(
                select(feedback.c.id, feedback.c.request_id, feedback.c.event_id, feedback.c.kind,
                       feedback.c.value, feedback.c.ts, feedback.c.body)
                .where(feedback.c.request_id.in_(ids))
            ).all()
            stored = dict(conn.execute(
                select(rewards.c.request_id, rewards.c.last_feedback_id)
                .where(and_(rewards.c.spec_version == spec_version, rewards.c.request_id.in_(ids)))
            ).all())
        by_request: dict[str, list[Any]] = {}
        for f in fb_rows:
            by_request.setdefault(f.request_id, []).append(f)
        episodes = [r for r in rows if first[r.request_id] == r.id]
        yield EpisodeChunk(episodes, by_request, stored, duplicates=len(rows) - len(episodes))


def upsert_rewards(engine: Engine, rows: list[dict[str, Any]]) -> None:
    """Insert or replace rewards on (request_id, spec_version)."""
    if not rows:
        return
    now = utcnow()
    for row in rows:
        row.setdefault("computed_at", now)
    with engine.begin() as conn:
        dialect = sqlite if conn.dialect.name == "sqlite" else postgresql
        stmt = dialect.insert(rewards)
        stmt = stmt.on_conflict_do_update(
            index_elements=["request_id", "spec_version"],
            set_={c: stmt.excluded[c] for c in
                  ("policy_version", "value", "components", "feedback_count", "last_feedback_id", "computed_at")},
        )
        conn.execute(stmt, rows)


def stored_reward(engine: Engine, request_id: str, spec_version: str) -> Any | None:
    with engine.connect() as conn:
        return conn.execute(
            select(rewards).where(and_(rewards.c.request_id == request_id, rewards.c.spec_version == spec_version))
        ).first()


def orphaned_feedback(engine: Engine, older_than: datetime) -> int:
    """Feedback older than `older_than` whose interaction never arrived."""
    stmt = (
        select(func.count())
        .select_from(feedback.outerjoin(interactions, interactions.c.request_id == feedback.c.request_id))
        .where(and_(interactions.c.id.is_(None), feedback.c.ts < older_than))
    )
    with engine.connect() as conn:
        return conn.scalar(stmt)


def judge_scores_for(engine: Engine, request_ids: Sequence[str], judge_version: str) -> dict[str, float]:
    if not request_ids:
        return {}
    stmt = select(judge_scores.c.request_id, judge_scores.c.score).where(
        and_(judge_scores.c.judge_version == judge_version, judge_scores.c.request_id.in_(list(request_ids)))
    )
    with engine.connect() as conn:
        return dict(conn.execute(stmt).all())


def store_judge_scores(engine: Engine, judge_version: str, scores: dict[str, float]) -> None:
    rows = [{"request_id": r, "judge_version": judge_version, "score": s} for r, s in scores.items()]
    with engine.begin() as conn:
        insert_ignore(conn, judge_scores, rows, ["request_id", "judge_version"], same={"computed_at": utcnow()})


def trained_request_ids(engine: Engine, request_ids: Sequence[str], spec_version: str) -> set[str]:
    """Which of these episodes a training run has already used (with this spec's rewards)."""
    if not request_ids:
        return set()
    stmt = select(training_episodes.c.request_id).where(
        and_(training_episodes.c.spec_version == spec_version,
             training_episodes.c.request_id.in_(list(request_ids)))
    )
    with engine.connect() as conn:
        return set(conn.scalars(stmt))
