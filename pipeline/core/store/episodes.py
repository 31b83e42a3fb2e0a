"""Queries over agent episodes (interactions that share an `episode_id`) as a whole: what the
agent demo's report and `rtrl sim --task agent` measure per policy version.

An episode belongs to the version that answered its first call (its lowest step, then its
earliest); it succeeded when an `accepted` event with a positive value names the episode (the
episode-level counterpart of served_and_accepted's definition); a call "wrote a malformed tool
call" as pipeline.core.textchecks.malformed_tool_call says.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import orjson
from sqlalchemy import Engine, select

from pipeline.core.store.tables import feedback, interactions
from pipeline.core.textchecks import malformed_tool_call


@dataclass(frozen=True)
class EpisodeSummary:
    episode_id: str
    started: datetime  # its first call
    version: str  # the policy version that answered its first call
    calls: int
    tool_errors: int  # calls that wrote a malformed tool call
    succeeded: bool


def wrote_malformed_call(output_tool_calls: str | None) -> bool:
    """Whether a stored call (its `interactions.output_tool_calls`, JSON text) wrote a malformed
    tool call."""
    if not output_tool_calls:
        return False
    return any(malformed_tool_call(c) for c in orjson.loads(output_tool_calls))


def episode_summaries(engine: Engine) -> list[EpisodeSummary]:
    """Every episode (of each tenant), oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                interactions.c.tenant,
                interactions.c.episode_id,
                interactions.c.step,
                interactions.c.ts,
                interactions.c.policy_version,
                interactions.c.output_tool_calls,
            ).where(interactions.c.episode_id.is_not(None))
        ).all()
        accepted = {
            (tenant, episode)
            for tenant, episode in conn.execute(
                select(feedback.c.tenant, feedback.c.episode_id).where(
                    feedback.c.episode_id.is_not(None), feedback.c.kind == "accepted", feedback.c.value > 0
                )
            )
        }
    calls: dict[tuple[str, str], list] = {}
    for tenant, episode_id, step, ts, version, tool_calls in rows:
        calls.setdefault((tenant, episode_id), []).append(
            (step if step is not None else 1 << 30, ts, version, tool_calls)
        )
    out = []
    for (tenant, episode_id), its in calls.items():
        first = min(its, key=lambda c: (c[0], c[1]))
        errors = sum(wrote_malformed_call(t) for *_, t in its)
        succeeded = (tenant, episode_id) in accepted or (None, episode_id) in accepted  # (None: any tenant's)
        out.append(EpisodeSummary(episode_id, first[1], first[2], len(its), errors, succeeded))
    return sorted(out, key=lambda e: e.started)
