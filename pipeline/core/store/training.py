"""Queries of the training stage: which rewarded episodes a run reads, its lineage, its record.

Selection, in one sentence: rewards of one spec version created after the parent run's
watermark (rewards.id grows as episodes ripen), whose interaction was served no earlier than
the staleness cutoff, optionally of one tenant, outside the held-out slice, the newest up to a
limit. Everything left out is counted by reason, so a run can say why it trained on fewer
episodes than the store holds.

Newest, not oldest: a backlog larger than the limit is not trained in full -- its older part is
left out (`over_limit`) and the run's watermark moves past it. Taking the oldest would keep the
watermark behind every unread episode, but after a rejected candidate the next cycle would
select the very same rows, see nothing new and skip, for as long as the backlog lasts (forever
with no staleness limit). The newest episodes are also the ones closest to the serving policy.

The held-out slice is fixed by a hash of the prompt: a prompt of the slice never trains, however
often it is asked (split by request id, a repeated prompt would be held out in some requests
and trained on in others, and the gate would measure memory, not generalisation). The gate evaluates
candidates on the most recent held-out episodes (select_eval_episodes).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import Engine, and_, exists, func, select, update

from pipeline.core.store.events import insert_ignore, utcnow
from pipeline.core.store.tables import cycles, interactions, rewards, training_episodes, training_runs
from pipeline.core.types import prompt_key


@dataclass
class Selection:
    rows: list[Any]  # reward_id, request_id, reward, event_id, policy_version, tenant, ts, body
    watermark_from: int
    watermark_to: int  # the newest reward id among the rows (watermark_from when none)
    counts: dict[str, int] = field(default_factory=dict)  # candidates, stale, other_tenant, over_limit


def _in_slice(key: bytes, percent: float) -> bool:
    return zlib.crc32(key) % 10_000 < percent * 100


def is_held_out(request_id: str, body: str | bytes, percent: float) -> bool:
    """Whether an episode (its request id and stored event body) belongs to the slice kept out
    of training for evaluation: by its prompt (by request id if the body has none)."""
    if not percent:
        return False
    try:
        prompt = orjson.loads(body)["prompt"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return _in_slice(request_id.encode(), percent)
    return _in_slice(prompt_key(prompt), percent)


def select_episodes(engine: Engine, spec_version: str, since_reward_id: int = 0,
                    served_after: datetime | None = None, tenant: str | None = None,
                    limit: int | None = None, holdout_percent: float = 0.0) -> Selection:
    """Rewarded episodes for a training run; see the module docstring."""
    joined = rewards.join(interactions, interactions.c.request_id == rewards.c.request_id)
    window = and_(rewards.c.spec_version == spec_version, rewards.c.id > since_reward_id)
    with engine.connect() as conn:
        candidates = conn.scalar(select(func.count()).select_from(rewards).where(window))
        stale = 0
        if served_after is not None:
            stale = conn.scalar(select(func.count(func.distinct(rewards.c.id))).select_from(joined).where(
                and_(window, interactions.c.ts < served_after)))
        other_tenant = 0
        keep = [window]
        if served_after is not None:
            keep.append(interactions.c.ts >= served_after)
        if tenant is not None:
            other_tenant = conn.scalar(select(func.count(func.distinct(rewards.c.id))).select_from(joined).where(
                and_(*keep, interactions.c.tenant != tenant)))
            keep.append(interactions.c.tenant == tenant)
        stmt = (select(rewards.c.id.label("reward_id"), rewards.c.request_id, rewards.c.value.label("reward"),
                       interactions.c.id.label("interaction_id"), interactions.c.event_id,
                       interactions.c.policy_version, interactions.c.tenant, interactions.c.ts, interactions.c.body)
                .select_from(joined).where(and_(*keep)).order_by(rewards.c.id, interactions.c.id))
        rows = []
        seen: set[int] = set()
        held_out = 0
        for row in conn.execute(stmt):
            if row.reward_id in seen:  # a producer sent two interactions for one request: the first counts
                continue
            seen.add(row.reward_id)
            if holdout_percent and is_held_out(row.request_id, row.body, holdout_percent):
                held_out += 1
                continue
            rows.append(row)
    over_limit = 0
    if limit is not None and len(rows) > limit:
        # the newest (see the module docstring); in reward order still
        over_limit, rows = len(rows) - limit, rows[len(rows) - limit:]
    counts = {"candidates": candidates, "stale": stale, "other_tenant": other_tenant, "held_out": held_out,
              "over_limit": over_limit, "selected": len(rows)}
    watermark_to = max((r.reward_id for r in rows), default=since_reward_id)
    return Selection(rows, since_reward_id, watermark_to, counts)


def select_eval_episodes(engine: Engine, spec_version: str, holdout_percent: float, limit: int,
                         served_after: datetime | None = None) -> list[Any]:
    """The most recent rewarded episodes of the held-out slice, newest first."""
    joined = rewards.join(interactions, interactions.c.request_id == rewards.c.request_id)
    where = [rewards.c.spec_version == spec_version]
    if served_after is not None:
        where.append(interactions.c.ts >= served_after)
    stmt = (select(rewards.c.request_id, rewards.c.value.label("reward"), interactions.c.policy_version,
                   interactions.c.ts, interactions.c.body)
            .select_from(joined).where(and_(*where)).order_by(interactions.c.ts.desc(), interactions.c.id))
    out, seen = [], set()
    with engine.connect() as conn:
        for row in conn.execution_options(yield_per=1000).execute(stmt):
            if row.request_id in seen or not is_held_out(row.request_id, row.body, holdout_percent):
                continue
            seen.add(row.request_id)
            out.append(row)
            if len(out) >= limit:
                break
    return out


def start_run(engine: Engine, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(training_runs.insert().values(status="running", started_at=utcnow(), **values))


def finish_run(engine: Engine, run_id: str, status: str, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(update(training_runs).where(training_runs.c.run_id == run_id)
                     .values(status=status, finished_at=utcnow(), **values))


def get_run(engine: Engine, run_id: str) -> Any | None:
    with engine.connect() as conn:
        return conn.execute(select(training_runs).where(training_runs.c.run_id == run_id)).first()


def latest_finished_run(engine: Engine, spec_version: str | None = None,
                        watermark_from: int | None = None, skip_failed_cycles: bool = False) -> Any | None:
    """The newest finished run, optionally of one spec and trained from one watermark (that is,
    continued from the same champion). With `skip_failed_cycles`, not a run whose cycle failed:
    its candidate was never judged or never promoted (say the registry was away), so it says
    nothing about its episodes."""
    where = [training_runs.c.status == "finished"]
    if skip_failed_cycles:
        where.append(~exists().where(and_(cycles.c.run_id == training_runs.c.run_id, cycles.c.state == "failed")))
    if spec_version is not None:
        where.append(training_runs.c.spec_version == spec_version)
    if watermark_from is not None:
        where.append(training_runs.c.watermark_from == watermark_from)
    with engine.connect() as conn:
        return conn.execute(select(training_runs).where(and_(*where))
                            .order_by(training_runs.c.finished_at.desc()).limit(1)).first()


def record_lineage(engine: Engine, run_id: str, spec_version: str, episodes: list[tuple[str, float]]) -> None:
    """The exact episodes (request_id, reward used) a run trained on."""
    rows = [{"request_id": rid, "reward": value} for rid, value in episodes]
    with engine.begin() as conn:
        insert_ignore(conn, training_episodes, rows, ["run_id", "request_id"],
                      same={"run_id": run_id, "spec_version": spec_version, "used_at": utcnow()})


def lineage(engine: Engine, run_id: str) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(select(training_episodes.c.request_id, training_episodes.c.reward)
                            .where(training_episodes.c.run_id == run_id)
                            .order_by(training_episodes.c.request_id)).all()
