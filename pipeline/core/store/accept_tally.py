"""served_and_accepted kept up to date by what is new: the daemon's per-cycle policy metrics at a
cost that follows the traffic since the last cycle, not the history.

A tally holds, per policy version, the requests served and how many of them were accepted (the
definition is served_and_accepted's), as of two safe watermarks (store.watermarks): the largest
interaction and feedback ids it has read. Reading it again adds

    the new interactions (ids above the interaction watermark)   served += 1 each, accepted += 1
                                                                 if an accept up to the new
                                                                 feedback watermark names it
    the old interactions a new accept names, that no accept      accepted += 1 each
    up to the old feedback watermark named

so that each interaction is counted accepted once, by whichever of the two reads first sees both
it and an accept. The first read of a process (and every read when the watermarks cannot be had)
is the full query.
"""

from __future__ import annotations

import threading

from sqlalchemy import Engine, and_, case, exists, func, select

from pipeline.core.store.online import served_and_accepted
from pipeline.core.store.tables import feedback, interactions
from pipeline.core.store.watermarks import safe_tops


def _accepted(up_to: int):
    """Whether an accept (an `accepted` event with a positive value) with a feedback id up to
    `up_to` names the interaction."""
    return exists().where(
        and_(
            feedback.c.request_id == interactions.c.request_id,
            feedback.c.kind == "accepted",
            feedback.c.value > 0,
            feedback.c.id <= up_to,
        )
    )


class AcceptTally:
    """One store's tally (the daemon keeps one); its reads may come from several threads."""

    def __init__(self) -> None:
        self.counts: dict[str, tuple[int, int]] = {}
        self.seen: tuple[int, int] | None = None  # (interaction id, feedback id) read up to
        self._lock = threading.Lock()

    def read(self, engine: Engine, versions: list[str] | None = None) -> dict[str, tuple[int, int]]:
        """served_and_accepted(engine, versions), from the tally brought up to date."""
        with self._lock:
            return self._read(engine, versions)

    def _read(self, engine: Engine, versions: list[str] | None) -> dict[str, tuple[int, int]]:
        tops = safe_tops(engine)
        if tops is None:
            self.seen = None
            return served_and_accepted(engine, versions)
        top_interaction, top_feedback = tops
        seen_interaction, seen_feedback = self.seen or (0, 0)
        counts = dict(self.counts) if self.seen else {}
        new = (
            select(interactions.c.policy_version, func.count(), func.sum(case((_accepted(top_feedback), 1), else_=0)))
            .where(interactions.c.id > seen_interaction, interactions.c.id <= top_interaction)
            .group_by(interactions.c.policy_version)
        )
        accepts = select(feedback.c.request_id).where(
            feedback.c.id > seen_feedback,
            feedback.c.id <= top_feedback,
            feedback.c.kind == "accepted",
            feedback.c.value > 0,
            feedback.c.request_id.is_not(None),
        )
        newly_accepted = (
            select(interactions.c.policy_version, func.count())
            .where(
                interactions.c.id <= seen_interaction, interactions.c.request_id.in_(accepts), ~_accepted(seen_feedback)
            )
            .group_by(interactions.c.policy_version)
        )
        with engine.connect() as conn:
            for version, served, accepted in conn.execute(new):
                was_served, was_accepted = counts.get(version, (0, 0))
                counts[version] = (was_served + served, was_accepted + int(accepted or 0))
            if self.seen:
                for version, accepted in conn.execute(newly_accepted):
                    was_served, was_accepted = counts[version]
                    counts[version] = (was_served, was_accepted + accepted)
        self.counts, self.seen = counts, tops
        return {v: n for v, n in counts.items() if versions is None or v in versions}
