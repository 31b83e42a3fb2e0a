"""Queries of the reward stage: episodes (interactions + their feedback) streamed in id order,
the rewards already stored, upserts, and orphaned feedback.

Set-based and streamed: each chunk of interactions costs two queries (its episodes, each with its
feedback and its stored reward; a count of its duplicates), whatever the size of the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Engine, String, and_, case, exists, func, null, or_, select, true, tuple_, type_coerce

from pipeline.core.store.events import count_of, utcnow
from pipeline.core.store.inserts import insert_ignore
from pipeline.core.store.tables import feedback, interactions, judge_scores, rewards, same_episode, training_episodes


class EpisodeRow(NamedTuple):
    """One episode as iter_episode_chunks reads it: the interaction's columns, its feedback and
    its stored reward's mark, as the driver hands them over (no SQLAlchemy type processing: this
    is read once per episode of every reward run)."""

    id: int
    request_id: str
    ts: datetime | str  # SQLite hands over ISO text (see iter_episode_chunks)
    policy_version: str
    output_text: str | None
    output_tool_calls: str | None  # JSON text of the calls the policy wrote, None without
    expects_attempt: bool | int | None
    feedback: str | list[Any]  # JSON (text on SQLite, parsed on PostgreSQL): read it with feedback_rows
    stored: int | None  # the last_feedback_id of the episode's reward under the spec; None: no reward yet
    body: str | None  # the interaction's body (its prompt), None unless asked for
    episode_id: str | None
    outcome: str | list[Any] | None  # the agent episode's outcome, JSON: read it and `calls` with episode_rows
    calls: str | list[Any] | None  # None for a call that is its own episode


@dataclass
class EpisodeChunk:
    interactions: list[EpisodeRow]
    duplicates: int = 0  # further interactions for a request_id: only the first one is an episode
    current: int = 0  # with only_stale: episodes left out because their reward is up to date
    span: tuple[int, int] | None = None  # the ids (lo, hi] the chunk covers; None when read by ids


def interaction_id_span(engine: Engine) -> int:
    """How many interaction ids the store spans (max - min + 1; 0 when empty): the size of a
    full reward run, from the primary key alone."""
    with engine.connect() as conn:
        first, last = conn.execute(select(func.min(interactions.c.id), func.max(interactions.c.id))).one()
    return 0 if first is None else last - first + 1


def feedback_rows(row: EpisodeRow) -> tuple[int, list[list[Any]]]:
    """An episode row's feedback: (the newest feedback id, 0 when none; the events as [id,
    event_id, kind, value, ts (ISO text), body or None] each). SQLite hands the JSON over as
    text, PostgreSQL's driver parses it (and gives None for an empty aggregate)."""
    found = row.feedback
    newest, events = orjson.loads(found) if isinstance(found, str) else found
    return newest or 0, events or []


def _feedback_json(dialect: str, payload_kinds: Sequence[str] | None, on: Any = None):
    """A correlated subquery: [newest feedback id, [[id, event_id, kind, value, ts, body], ...]]
    of the interaction's feedback (`on`: which feedback; default, the request's) as one JSON value,
    built by SQLite or PostgreSQL in C. Three rows per episode through the driver and
    SQLAlchemy's row processing cost more: the chunk reads of a 100k-episode run went from
    2.9 s to 1.8 s. (The newest id, which the stored reward is compared with, costs nothing
    here and 1.3 us per episode in Python.)"""
    agg, array = (
        (func.json_group_array, func.json_array) if dialect == "sqlite" else (func.json_agg, func.json_build_array)
    )
    body = (
        feedback.c.body
        if payload_kinds is None
        else case((feedback.c.kind.in_(list(payload_kinds)), feedback.c.body), else_=null())
    )
    events = agg(array(feedback.c.id, feedback.c.event_id, feedback.c.kind, feedback.c.value, feedback.c.ts, body))
    on = feedback.c.request_id == interactions.c.request_id if on is None else on
    return select(array(func.max(feedback.c.id), events)).where(on).scalar_subquery()


def _episode_json(dialect: str, payload_kinds: Sequence[str] | None):
    """Two correlated subqueries for a call of an agent episode (NULL for a call that is its own
    episode, without a probe): its episode's outcome, as _feedback_json's value of the feedback
    naming the episode, and its episode's calls as [[request_id, step, ts], ...] (the call's
    place and the episode's last call are worked out from these in Python: episodes are short)."""
    agg, array = (
        (func.json_group_array, func.json_array) if dialect == "sqlite" else (func.json_agg, func.json_build_array)
    )
    outcome = _feedback_json(
        dialect, payload_kinds, on=same_episode(interactions, feedback, any_tenant=feedback.c.tenant.is_(None))
    )
    calls = interactions.alias("calls")
    siblings = (
        select(agg(array(calls.c.request_id, calls.c.step, calls.c.ts)))
        .where(same_episode(calls, interactions))
        .scalar_subquery()
    )
    alone = interactions.c.episode_id.is_(None)
    return case((alone, null()), else_=outcome), case((alone, null()), else_=siblings)


def episode_rows(row: EpisodeRow) -> tuple[int, list[list[Any]], list[list[Any]]] | None:
    """A chunk row's agent episode: (the newest outcome feedback id, 0 when none; the outcome's
    events as feedback_rows gives them; the episode's calls as [request_id, step, ts (ISO
    text)]), None for a call that is its own episode."""
    if row.episode_id is None:
        return None
    found, calls = row.outcome, row.calls
    newest, events = (orjson.loads(found) if isinstance(found, str) else found) or (None, None)
    # an episode's calls include this one: never empty once episode_id is set
    return newest or 0, events or [], (orjson.loads(calls) if isinstance(calls, str) else calls) or []


def iter_episode_chunks(
    engine: Engine,
    spec_version: str,
    chunk: int = 5000,
    request_ids: Sequence[str] | None = None,
    payload_kinds: Sequence[str] | None = None,
    part: tuple[int, int] = (0, 1),
    only_stale: bool = False,
    served_since: datetime | None = None,
    with_body: bool = False,
    span: tuple[int, int] | None = None,
    ids: Sequence[int] | None = None,
) -> Iterator[EpisodeChunk]:
    """Episodes -- the first interaction of each request_id (or of those in `request_ids`) --
    with their feedback and stored reward, in id order.

    A chunk is a fixed-width range of interaction ids; `part=(k, n)` yields only the chunks
    whose index is k modulo n, so n workers can split one run with no coordination. Each
    episode's feedback comes back as one JSON array (see _feedback_json), found through the
    request_id index. What the policy wrote comes from the columns ingest extracted; the
    interaction's body (its prompt: a judge's business) only `with_body`. Feedback bodies are
    read only for `payload_kinds` (None: all); the others come back as None. With
    `only_stale`, episodes whose reward under `spec_version` already counts all their feedback
    are left in the store (counted, not read): an incremental run reads only what changed.
    Interactions that arrive during the run are left to the next one. With
    `served_since`, the chunks start at the first interaction served from then on (found
    through the ts index; ids after it that were served earlier, arriving late, are read too).
    With `span=(first, last)`, the chunks cover those ids instead. With `ids` (first
    interactions of their requests, ascending), those episodes, `chunk` at a time.
    """
    where = interactions.c.request_id.in_(list(request_ids)) if request_ids is not None else true()
    k, n = part
    earlier = interactions.alias("earlier")
    siblings = interactions.alias("siblings")
    # Scalar subqueries, each one index probe per row. PostgreSQL plans from its statistics, and
    # those of a rewards table that was empty when last analysed (a fresh store's first run, say
    # after a replay of history) make a scan of it look free: a scan per episode, of a table the
    # run keeps filling -- quadratic (docs/benchmarks.md). So the chunk queries run with
    # sequential scans off, and without NOT EXISTS, which PostgreSQL turns into an anti-join
    # planned from the same statistics; and without JIT, whose compilation costs a large share
    # of a chunk's read, for a plan the cost model overrates.
    # a request is one episode: its first interaction (a producer that sent two is buggy)
    first = interactions.c.id == (
        select(func.min(earlier.c.id)).where(earlier.c.request_id == interactions.c.request_id).scalar_subquery()
    )
    stored = (
        select(rewards.c.last_feedback_id)
        .where(and_(rewards.c.request_id == interactions.c.request_id, rewards.c.spec_version == spec_version))
        .scalar_subquery()
    )
    # Stale: the episode has feedback its reward does not count. By count, not by the newest id:
    # ids are handed out at insert, not at commit, so on PostgreSQL a feedback row committed late
    # by one lane can carry a smaller id than one another lane committed before a reward run read
    # it -- its reward's "newest id" then already covers the late row, which was missed for good.
    # Feedback rows are never deleted, so any row committed after a run read the episode raises
    # its count above the stored one, whatever its id.
    stored_count = (
        select(rewards.c.feedback_count)
        .where(and_(rewards.c.request_id == interactions.c.request_id, rewards.c.spec_version == spec_version))
        .scalar_subquery()
    )
    count = select(func.count()).where(feedback.c.request_id == interactions.c.request_id).scalar_subquery()
    # a call of an agent episode also reflects the episode's outcome and its calls (a late call
    # moves the others' place from the end): reward.scoring.inputs_counted counts the same
    in_episode = case(
        (interactions.c.episode_id.is_(None), 0),
        else_=(
            select(func.count())
            .where(same_episode(interactions, feedback, any_tenant=feedback.c.tenant.is_(None)))
            .scalar_subquery()
            + select(func.count()).select_from(siblings).where(same_episode(siblings, interactions)).scalar_subquery()
        ),
    )
    # (no reward yet is tested first: a first run then never counts)
    stale = or_(stored_count.is_(None), count + in_episode != stored_count)
    # ts as the driver gives it (SQLite: ISO text; build_episode parses it): SQLAlchemy's own
    # DateTime parsing was a fifth of the time spent reading a chunk
    # in EpisodeRow's order, each labelled with its field's name
    columns = [
        c.label(name)
        for name, c in zip(
            EpisodeRow._fields,
            (
                interactions.c.id,
                interactions.c.request_id,
                type_coerce(interactions.c.ts, String),
                interactions.c.policy_version,
                interactions.c.output_text,
                interactions.c.output_tool_calls,
                interactions.c.expects_attempt,
                _feedback_json(engine.dialect.name, payload_kinds),
                stored,
                interactions.c.body if with_body else null(),
                interactions.c.episode_id,
                *_episode_json(engine.dialect.name, payload_kinds),
            ),
            strict=True,
        )
    ]
    if ids is not None:
        for i in range(k * chunk, len(ids), n * chunk):
            batch = list(ids[i : i + chunk])
            with engine.connect() as conn:
                if conn.dialect.name == "postgresql":
                    conn.exec_driver_sql("SET LOCAL enable_seqscan = off; SET LOCAL jit = off")  # see above
                wanted = and_(interactions.c.id.in_(batch), stale if only_stale else true())
                found = conn.execute(select(*columns).where(wanted).order_by(interactions.c.id)).all()
                rows = [EpisodeRow._make(r) for r in found]
            yield EpisodeChunk(rows, current=len(batch) - len(rows) if only_stale else 0)
        return
    if span is not None:
        first_id, last_id = span
    else:
        with engine.connect() as conn:
            first_id, last_id = conn.execute(
                select(func.min(interactions.c.id), func.max(interactions.c.id)).where(where)
            ).one()
            if served_since is not None and first_id is not None:
                first_id = conn.scalar(
                    select(func.min(interactions.c.id)).where(where, interactions.c.ts >= served_since)
                )
    if first_id is None:
        return
    for lo in range(first_id - 1 + k * chunk, last_id, n * chunk):  # the range (lo, lo + chunk]
        # capped at the last id: an interaction that arrives between the two queries is the next run's
        rng = and_(where, interactions.c.id > lo, interactions.c.id <= min(lo + chunk, last_id))
        with engine.connect() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SET LOCAL enable_seqscan = off; SET LOCAL jit = off")  # see above
            total, duplicates = conn.execute(
                select(func.count(), func.coalesce(func.sum(case((first, 0), else_=1)), 0)).where(rng)
            ).one()
            if not total:
                continue
            # `first` costs an index probe per row: only a chunk with duplicates needs it again.
            # stale first: in an incremental run most episodes are up to date, and `first` is skipped
            wanted = and_(rng, stale if only_stale else true(), first if duplicates else true())
            found = conn.execute(select(*columns).where(wanted).order_by(interactions.c.id)).all()
            rows = [EpisodeRow._make(r) for r in found]
        # the first interactions not read are the up-to-date ones (a count for the report: a write
        # between the two queries can shift it by that write, never change a reward)
        up_to_date = total - duplicates - len(rows) if only_stale else 0
        yield EpisodeChunk(rows, duplicates=duplicates, current=up_to_date, span=(lo, min(lo + chunk, last_id)))


class RewardRow(NamedTuple):
    """One reward to upsert (under a spec version given with the batch)."""

    request_id: str
    policy_version: str
    value: float
    components: dict[str, float]  # "signal.accepted": 0.5, "guard.abstention": -0.6, ...
    feedback_count: int  # what the value reflects (see tables.rewards)
    last_feedback_id: int  # the newest feedback row the value reflects
    outcome: dict[str, Any] | None = None  # the agent episode's outcome it credited (see tables.rewards)


_COLUMNS = (
    "request_id",
    "spec_version",
    "policy_version",
    "value",
    "components",
    "feedback_count",
    "last_feedback_id",
    "outcome",
    "computed_at",
)
# Sent to the driver as is, because it runs for every reward of a run: SQLAlchemy's
# per-row parameter processing cost more than the insert itself. The statement is the same
# in SQLite and PostgreSQL but for the placeholders; values are made driver-ready here.
_UPSERT = (
    "INSERT INTO rewards (" + ", ".join(_COLUMNS) + ") VALUES ({values}) "
    "ON CONFLICT (request_id, spec_version) DO UPDATE SET " + ", ".join(f"{c} = excluded.{c}" for c in _COLUMNS[2:])
)


def upsert_rewards(engine: Engine, spec_version: str, rows: Sequence[RewardRow]) -> None:
    """Insert or replace rewards on (request_id, spec_version)."""
    if not rows:
        return
    stamp = utcnow()
    now: datetime | str = stamp
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            # the text format SQLAlchemy's DateTime writes and reads back on SQLite
            now = stamp.strftime("%Y-%m-%d %H:%M:%S.%f")
            sql = _UPSERT.format(values=", ".join("?" * len(_COLUMNS)))
        else:
            sql = _UPSERT.format(values=", ".join(["%s"] * len(_COLUMNS)))
        conn.exec_driver_sql(
            sql,
            [
                (
                    request_id,
                    spec_version,
                    policy_version,
                    float(value),
                    orjson.dumps(components).decode(),
                    feedback_count,
                    last_feedback_id,
                    None if outcome is None else orjson.dumps(outcome).decode(),
                    now,
                )
                for request_id, policy_version, value, components, feedback_count, last_feedback_id, outcome in rows
            ],
        )


@dataclass(frozen=True)
class StoredReward:
    """An episode's reward under one spec version, as the reward stage last wrote it."""

    id: int  # grows as episodes ripen: training's watermark
    request_id: str
    spec_version: str
    policy_version: str
    value: float
    components: dict[str, float]  # "signal.accepted": 0.5, "guard.abstention": -0.6
    feedback_count: int  # the feedback (and outcome events and calls of its episode) it reflects
    last_feedback_id: int
    computed_at: datetime
    outcome: dict[str, Any] | None  # a call of an agent episode: {"episode_id", "events", "credit"}

    @classmethod
    def from_row(cls, row: Any) -> StoredReward:
        return cls(
            row.id,
            row.request_id,
            row.spec_version,
            row.policy_version,
            row.value,
            row.components,
            row.feedback_count,
            row.last_feedback_id,
            row.computed_at,
            row.outcome,
        )


def stored_reward(engine: Engine, request_id: str, spec_version: str) -> StoredReward | None:
    with engine.connect() as conn:
        row = conn.execute(
            select(rewards).where(and_(rewards.c.request_id == request_id, rewards.c.spec_version == spec_version))
        ).first()
    return StoredReward.from_row(row) if row is not None else None


def orphaned_feedback(engine: Engine, older_than: datetime, since: datetime | None = None) -> int:
    """Feedback older than `older_than` (and from `since` on) whose interaction never arrived.

    Two steps: the request_ids that have feedback but no interaction (a walk of the request_id
    index, each probe next to the last), then their feedback older than the TTL. Every reward
    run counts this over the whole history; joining each feedback row to its interaction
    instead read 3M rows through the ts index at 1M episodes (2.5 s against 0.8 s on SQLite)."""
    window = feedback.c.ts >= since if since is not None else true()
    total = 0
    with engine.connect() as conn:
        # feedback on one call by request_id (NULL: an episode's outcome)
        with_feedback = (
            select(feedback.c.request_id.label("key"))
            .where(window, feedback.c.request_id.is_not(None))
            .distinct()
            .subquery()
        )
        orphans = select(with_feedback.c.key).where(~exists().where(interactions.c.request_id == with_feedback.c.key))
        total += count_of(
            conn,
            select(func.count())
            .select_from(feedback)
            .where(feedback.c.request_id.in_(orphans), feedback.c.ts < older_than, window),
        )
        # an episode's outcome whose tenant has no call of that episode (the same two steps, by
        # pair; '' stands for a tenant not named, which any tenant's calls match)
        named = func.coalesce(feedback.c.tenant, "")
        pairs = (
            select(feedback.c.episode_id, named.label("tenant"))
            .where(window, feedback.c.episode_id.is_not(None))
            .distinct()
            .subquery()
        )
        orphans = select(pairs.c.episode_id, pairs.c.tenant).where(
            ~exists().where(same_episode(interactions, pairs, any_tenant=pairs.c.tenant == ""))
        )
        total += count_of(
            conn,
            select(func.count())
            .select_from(feedback)
            .where(tuple_(feedback.c.episode_id, named).in_(orphans), feedback.c.ts < older_than, window),
        )
    return total


def episode_request_ids(engine: Engine, episode_id: str, tenant: str | None = None) -> list[str]:
    """The request ids of tenant `tenant`'s agent episode's calls, in the order they were stored
    (None: the one tenant that has an episode of that id; ValueError naming them if several do)."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(interactions.c.request_id, interactions.c.tenant)
            .where(interactions.c.episode_id == episode_id, *([interactions.c.tenant == tenant] if tenant else []))
            .order_by(interactions.c.id)
        ).all()
    tenants = sorted({t for _, t in rows})
    if len(tenants) > 1:
        raise ValueError(f"tenants {', '.join(tenants)} each have an episode {episode_id!r}: name one")
    return [r for r, _ in rows]


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
        and_(training_episodes.c.spec_version == spec_version, training_episodes.c.request_id.in_(list(request_ids)))
    )
    with engine.connect() as conn:
        return set(conn.scalars(stmt))


def mean_rewards(engine: Engine, spec_version: str) -> dict[str, float]:
    """Per policy version: the mean of its episodes' rewards under `spec_version`."""
    with engine.connect() as conn:
        return {
            v: float(m)
            for v, m in conn.execute(
                select(rewards.c.policy_version, func.avg(rewards.c.value))
                .where(rewards.c.spec_version == spec_version)
                .group_by(rewards.c.policy_version)
            )
        }


def latest_request_id(engine: Engine) -> str | None:
    """The request id of the newest stored interaction (None: none stored)."""
    with engine.connect() as conn:
        return conn.scalar(select(interactions.c.request_id).order_by(interactions.c.id.desc()).limit(1))
