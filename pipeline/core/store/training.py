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

The held-out slice is fixed by a hash of the task (the first user message): a task of the slice
never trains, however often it is asked (split by request id, a repeated prompt would be held out
in some requests and trained on in others, and the gate would measure memory, not
generalisation). The task of a call of an agent episode is its episode's: its first call's --
a call whose prompt is a summary the agent wrote of its own earlier calls starts with another
user message, yet belongs to the same task and the same side. The gate evaluates candidates on
the most recent held-out episodes (select_eval_episodes).

Calls another model served (pipeline.core.types.is_our_version: a frozen sub-agent's in the
episode of a trained orchestrator) are neither trained on nor evaluated (`other_policy`); their
episode's outcome still credits the calls our policy made.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson
from sqlalchemy import Engine, Row, and_, exists, func, select, update

from pipeline.core.store.events import count_of, utcnow
from pipeline.core.store.inserts import insert_ignore
from pipeline.core.store.tables import cycles, interactions, rewards, training_episodes, training_runs
from pipeline.core.types import is_our_version, task_key


@dataclass(frozen=True)
class RunRecord:
    """A training run as the store keeps it (one row of `training_runs`): what the cycle, the
    gate's staging, the CLI and the demo read back."""

    run_id: str
    tracking_run_id: str | None  # the MLflow run
    status: str  # running | finished | failed
    spec_version: str
    loss: str
    base_model: str  # the base's path as the run loaded it
    base_revision: str
    parent_run_id: str | None  # the run whose adapter this one continued
    watermark_from: int
    watermark_to: int
    episodes: int
    adapter_path: str | None
    summary: dict[str, Any] | None  # final metrics and selection counts
    error: str | None
    started_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> RunRecord:
        return cls(
            row.run_id,
            row.tracking_run_id,
            row.status,
            row.spec_version,
            row.loss,
            row.base_model,
            row.base_revision,
            row.parent_run_id,
            row.watermark_from,
            row.watermark_to,
            row.episodes,
            row.adapter_path,
            row.summary,
            row.error,
            row.started_at,
            row.finished_at,
        )


@dataclass
class Selection:
    rows: list[Any]  # reward_id, request_id, reward, event_id, policy_version, tenant, ts, body
    watermark_from: int
    watermark_to: int  # the newest reward id among the rows (watermark_from when none)
    counts: dict[str, int] = field(default_factory=dict)  # candidates, stale, other_tenant, over_limit
    tasks: dict[str, bytes] = field(default_factory=dict)  # request id -> its task (task_of), every row


def _in_slice(key: bytes, percent: float) -> bool:
    return zlib.crc32(key) % 10_000 < percent * 100


def is_held_out(request_id: str, body: str | bytes, percent: float, task: bytes | None = None) -> bool:
    """Whether an episode (its request id and stored event body) belongs to the slice kept out
    of training for evaluation: by its task (`task`, else task_of(body): a chat prompt's first
    user message, so every call of an agent's task and every ask of it under another system
    prompt fall on one side; a text prompt whole), by request id if the body has none."""
    if not percent:
        return False
    if task is None:
        task = task_of(body)
    return _in_slice(task if task is not None else request_id.encode(), percent)


def task_of(body: str | bytes) -> bytes | None:
    """The task of a stored event body (pipeline.core.types.task_key of its prompt); None when it
    has no readable prompt."""
    return _episode_and_task(body)[1]


EpisodeKey = tuple[str, str]  # (tenant, episode id): episode ids are the applications', per tenant


def _episode_and_task(body: str | bytes) -> tuple[EpisodeKey | None, bytes | None]:
    """A stored event body's episode (tenant, id) and task (None where it has none), from one parse."""
    try:
        ev = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None
    if not isinstance(ev, dict):
        return None, None
    episode, tenant = ev.get("episode_id"), ev.get("tenant")
    key = (tenant if isinstance(tenant, str) else "default", episode) if isinstance(episode, str) else None
    return key, (task_key(ev["prompt"]) if "prompt" in ev else None)


def episode_tasks(conn: Any, episodes: set[EpisodeKey]) -> dict[EpisodeKey, bytes]:
    """The task of each episode: its first call's (lowest step, then earliest), whatever later
    calls' prompts start with (an agent's summary of its own context, say)."""
    out: dict[EpisodeKey, tuple] = {}
    ids = sorted({episode for _, episode in episodes})
    for k in range(0, len(ids), 500):
        stmt = select(
            interactions.c.tenant,
            interactions.c.episode_id,
            interactions.c.step,
            interactions.c.ts,
            interactions.c.id,
            interactions.c.body,
        ).where(interactions.c.episode_id.in_(ids[k : k + 500]))
        for tenant, episode_id, step, ts, row_id, body in conn.execute(stmt):
            key = (tenant, episode_id)
            if key not in episodes:
                continue  # another tenant's episode of the same id
            order = (step if step is not None else 1 << 30, str(ts), row_id)
            if key not in out or order < out[key][0]:
                out[key] = (order, body)
    return {e: task for e, (_, body) in out.items() if (task := task_of(body)) is not None}


def _tasks(conn: Any, rows: list[Any]) -> dict[str, bytes]:
    """Each row's task (request id -> task): its episode's when it belongs to one."""
    parsed = {r.request_id: _episode_and_task(r.body) for r in rows}
    episodes = {e for e, _ in parsed.values() if e is not None}
    by_episode = episode_tasks(conn, episodes) if episodes else {}
    out = {}
    for request_id, (episode, own) in parsed.items():
        task = by_episode.get(episode) if episode is not None else None
        if (task := task if task is not None else own) is not None:
            out[request_id] = task
    return out


def select_episodes(
    engine: Engine,
    spec_version: str,
    since_reward_id: int = 0,
    served_after: datetime | None = None,
    tenant: str | None = None,
    limit: int | None = None,
    holdout_percent: float = 0.0,
) -> Selection:
    """Rewarded episodes for a training run; see the module docstring."""
    joined = rewards.join(interactions, interactions.c.request_id == rewards.c.request_id)
    window = and_(rewards.c.spec_version == spec_version, rewards.c.id > since_reward_id)
    with engine.connect() as conn:
        candidates = count_of(conn, select(func.count()).select_from(rewards).where(window))
        stale = 0
        if served_after is not None:
            stale = count_of(
                conn,
                select(func.count(func.distinct(rewards.c.id)))
                .select_from(joined)
                .where(and_(window, interactions.c.ts < served_after)),
            )
        other_tenant = 0
        keep = [window]
        if served_after is not None:
            keep.append(interactions.c.ts >= served_after)
        if tenant is not None:
            other_tenant = count_of(
                conn,
                select(func.count(func.distinct(rewards.c.id)))
                .select_from(joined)
                .where(and_(*keep, interactions.c.tenant != tenant)),
            )
            keep.append(interactions.c.tenant == tenant)
        stmt = (
            select(
                rewards.c.id.label("reward_id"),
                rewards.c.request_id,
                rewards.c.value.label("reward"),
                rewards.c.outcome,
                interactions.c.id.label("interaction_id"),
                interactions.c.event_id,
                interactions.c.policy_version,
                interactions.c.tenant,
                interactions.c.ts,
                interactions.c.body,
            )
            .select_from(joined)
            .where(and_(*keep))
            .order_by(rewards.c.id, interactions.c.id)
        )
        found = []
        seen: set[int] = set()
        other_policy = 0
        for row in conn.execute(stmt):
            if row.reward_id in seen:  # a producer sent two interactions for one request: the first counts
                continue
            seen.add(row.reward_id)
            if not is_our_version(row.policy_version):
                other_policy += 1
                continue
            found.append(row)
        tasks = _tasks(conn, found)
        rows = [r for r in found if not is_held_out(r.request_id, r.body, holdout_percent, tasks.get(r.request_id))]
        held_out = len(found) - len(rows)
    over_limit = 0
    if limit is not None and len(rows) > limit:
        # the newest (see the module docstring); in reward order still
        over_limit, rows = len(rows) - limit, rows[len(rows) - limit :]
    counts = {
        "candidates": candidates,
        "stale": stale,
        "other_tenant": other_tenant,
        "other_policy": other_policy,
        "held_out": held_out,
        "over_limit": over_limit,
        "selected": len(rows),
    }
    watermark_to = max((r.reward_id for r in rows), default=since_reward_id)
    return Selection(
        rows,
        since_reward_id,
        watermark_to,
        counts,
        {r.request_id: tasks[r.request_id] for r in rows if r.request_id in tasks},
    )


def select_eval_episodes(
    engine: Engine, spec_version: str, holdout_percent: float, limit: int, served_after: datetime | None = None
) -> list[Any]:
    """The most recent rewarded episodes of the held-out slice, newest first."""
    joined = rewards.join(interactions, interactions.c.request_id == rewards.c.request_id)
    where = [rewards.c.spec_version == spec_version]
    if served_after is not None:
        where.append(interactions.c.ts >= served_after)
    stmt = (
        select(
            rewards.c.request_id,
            rewards.c.value.label("reward"),
            interactions.c.policy_version,
            interactions.c.ts,
            interactions.c.body,
        )
        .select_from(joined)
        .where(and_(*where))
        .order_by(interactions.c.ts.desc(), interactions.c.id)
    )
    out, seen = [], set()
    tasks: dict[EpisodeKey, bytes] = {}  # an episode's task, looked up once per episode
    with engine.connect() as conn, engine.connect() as lookup:
        for row in conn.execution_options(yield_per=1000).execute(stmt):
            if row.request_id in seen or not is_our_version(row.policy_version):
                continue
            episode, own = _episode_and_task(row.body)
            if episode is not None and episode not in tasks:
                tasks.update(episode_tasks(lookup, {episode}))
            task = tasks.get(episode) if episode is not None else None
            if not is_held_out(row.request_id, row.body, holdout_percent, task if task is not None else own):
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
        conn.execute(
            update(training_runs)
            .where(training_runs.c.run_id == run_id)
            .values(status=status, finished_at=utcnow(), **values)
        )


def get_run(engine: Engine, run_id: str) -> RunRecord | None:
    with engine.connect() as conn:
        row = conn.execute(select(training_runs).where(training_runs.c.run_id == run_id)).first()
    return RunRecord.from_row(row) if row is not None else None


def latest_finished_run(
    engine: Engine, spec_version: str | None = None, watermark_from: int | None = None, skip_failed_cycles: bool = False
) -> RunRecord | None:
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
        row = conn.execute(
            select(training_runs).where(and_(*where)).order_by(training_runs.c.finished_at.desc()).limit(1)
        ).first()
    return RunRecord.from_row(row) if row is not None else None


def record_lineage(
    engine: Engine, run_id: str, spec_version: str, episodes: list[tuple[str, float, dict[str, Any] | None]]
) -> None:
    """The exact episodes (request_id, reward used, the agent episode outcome it credited) a
    run trained on."""
    rows = [{"request_id": rid, "reward": value, "outcome": outcome} for rid, value, outcome in episodes]
    with engine.begin() as conn:
        insert_ignore(
            conn,
            training_episodes,
            rows,
            ["run_id", "request_id"],
            same={"run_id": run_id, "spec_version": spec_version, "used_at": utcnow()},
        )


def lineage(engine: Engine, run_id: str) -> Sequence[Row]:
    with engine.connect() as conn:
        return conn.execute(
            select(training_episodes.c.request_id, training_episodes.c.reward, training_episodes.c.outcome)
            .where(training_episodes.c.run_id == run_id)
            .order_by(training_episodes.c.request_id)
        ).all()
