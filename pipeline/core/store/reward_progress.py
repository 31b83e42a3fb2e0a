"""Queries of an incremental reward run (reward/stage.py): its progress row and waiting feedback,
and the settled episodes that changed since the last run. The ids a run reads up to come from
store/watermarks.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Engine, String, and_, case, delete, exists, func, literal, or_, select
from sqlalchemy.dialects import postgresql, sqlite

from pipeline.core.store.events import count_of, utcnow
from pipeline.core.store.tables import feedback, interactions, reward_progress, reward_waiting, same_episode

_CHUNK = 500  # values per IN (...)


@dataclass
class RewardProgress:
    """A spec's reward_progress row (see tables.reward_progress); the default: nothing settled."""

    settled_below: int = 0
    feedback_seen: int = 0
    episodes: int = 0
    duplicates: int = 0
    unusable: int = 0
    pending: list[str] = field(default_factory=list)


def load_progress(engine: Engine, spec_version: str) -> RewardProgress:
    with engine.connect() as conn:
        row = conn.execute(select(reward_progress).where(reward_progress.c.spec_version == spec_version)).first()
    if row is None:
        return RewardProgress()
    return RewardProgress(
        row.settled_below, row.feedback_seen, row.episodes, row.duplicates, row.unusable, list(row.pending)
    )


def save_progress(
    engine: Engine, spec_version: str, before: RewardProgress, after: RewardProgress, orphan_before: datetime
) -> int:
    """Save the progress a run made from `before` to `after`, and bring the spec's waiting
    feedback up to date in the same transaction (a run that fails before leaves both as they
    were); returns how many feedback rows are orphaned: waiting, and older than `orphan_before`.

    Waiting are the feedback rows read (ids up to feedback_seen) whose call, or agent episode,
    had not arrived: each run adds those of the feedback it read, and drops those whose call or
    episode has arrived since. Interactions are never deleted, so a row that had its interaction
    when read never becomes an orphan. The cost follows the new feedback and the waiting rows,
    not the history."""
    waiting = reward_waiting.c
    missing = or_(
        and_(feedback.c.request_id.is_not(None), ~exists().where(interactions.c.request_id == feedback.c.request_id)),
        and_(
            feedback.c.episode_id.is_not(None),
            ~exists().where(same_episode(interactions, feedback, any_tenant=feedback.c.tenant.is_(None))),
        ),
    )
    values = {
        "settled_below": after.settled_below,
        "feedback_seen": after.feedback_seen,
        "episodes": after.episodes,
        "duplicates": after.duplicates,
        "unusable": after.unusable,
        "pending": after.pending,
        "updated_at": utcnow(),
    }
    with engine.begin() as conn:
        ours = waiting.spec_version == spec_version
        if before.feedback_seen == 0:  # a first or forced run reads all the feedback again
            conn.execute(delete(reward_waiting).where(ours))
        insert = (postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert)(reward_waiting)
        conn.execute(
            insert.from_select(
                ["spec_version", "feedback_id", "ts"],
                select(literal(spec_version, String), feedback.c.id, feedback.c.ts).where(
                    feedback.c.id > before.feedback_seen, feedback.c.id <= after.feedback_seen, missing
                ),
            ).on_conflict_do_nothing()
        )  # a concurrent run of the same spec added it too
        found = select(feedback.c.id).where(feedback.c.id == waiting.feedback_id, ~missing)
        conn.execute(delete(reward_waiting).where(ours, exists(found)))
        done = conn.execute(
            reward_progress.update().where(reward_progress.c.spec_version == spec_version).values(**values)
        ).rowcount
        if not done:
            conn.execute(reward_progress.insert().values(spec_version=spec_version, **values))
        return count_of(conn, select(func.count()).select_from(reward_waiting).where(ours, waiting.ts < orphan_before))


def first_interaction_id(engine: Engine) -> int:
    """The smallest interaction id (1 for an empty store)."""
    with engine.connect() as conn:
        return conn.scalar(select(func.min(interactions.c.id))) or 1


def revisit_ids(engine: Engine, progress: RewardProgress, top_interaction: int, top_feedback: int) -> list[int]:
    """The settled episodes (first interactions below `settled_below`) a run must read again, by
    interaction id, ascending: those named by feedback stored since `feedback_seen` (on the call,
    or on its agent episode), the earlier calls of an agent episode that gained a call in the
    unsettled range, and the pending ones. Costs what is new, not the history."""
    lo = progress.settled_below
    if lo <= 0:
        return []
    new_feedback = and_(feedback.c.id > progress.feedback_seen, feedback.c.id <= top_feedback)
    with engine.connect() as conn:
        requests = set(
            conn.scalars(
                select(feedback.c.request_id).distinct().where(new_feedback, feedback.c.request_id.is_not(None))
            )
        )
        episodes = set(
            conn.scalars(
                select(feedback.c.episode_id).distinct().where(new_feedback, feedback.c.episode_id.is_not(None))
            )
        )
        episodes.update(
            conn.scalars(
                select(interactions.c.episode_id)
                .distinct()
                .where(
                    interactions.c.id >= lo,
                    interactions.c.id <= top_interaction,
                    interactions.c.episode_id.is_not(None),
                )
            )
        )
        for batch in _batches(sorted(episodes)):
            requests.update(
                conn.scalars(
                    select(interactions.c.request_id).where(
                        interactions.c.episode_id.in_(batch), interactions.c.id < lo
                    )
                )
            )
        requests.update(progress.pending)
        ids: list[int] = []
        first = func.min(interactions.c.id)
        for batch in _batches(sorted(requests)):
            ids.extend(
                conn.scalars(
                    select(first)
                    .where(interactions.c.request_id.in_(batch))
                    .group_by(interactions.c.request_id)
                    .having(first < lo)
                )
            )
    return sorted(ids)


def episode_counts(engine: Engine, lo: int, hi: int) -> tuple[int, int]:
    """(first interactions of a request, further ones) with ids in [lo, hi)."""
    if hi <= lo:
        return 0, 0
    earlier = interactions.alias("earlier")
    first = interactions.c.id == (
        select(func.min(earlier.c.id)).where(earlier.c.request_id == interactions.c.request_id).scalar_subquery()
    )
    with engine.connect() as conn:
        total, duplicates = conn.execute(
            select(func.count(), func.coalesce(func.sum(case((first, 0), else_=1)), 0)).where(
                interactions.c.id >= lo, interactions.c.id < hi
            )
        ).one()
    return total - duplicates, duplicates


def _batches(values: Sequence[str]) -> Iterable[Sequence[str]]:
    for i in range(0, len(values), _CHUNK):
        yield values[i : i + _CHUNK]
