"""Queries of the reward stage that read episodes: interactions with their feedback and their
stored reward's mark, streamed in id order (iter_episode_chunks), and the typed row each is read as.

Set-based and streamed: each chunk of interactions costs two queries (its episodes, each with its
feedback and its stored reward; a count of its duplicates), whatever the size of the store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Engine, String, and_, case, func, null, or_, select, true, type_coerce

from pipeline.core.store.tables import feedback, interactions, rewards, same_episode


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
