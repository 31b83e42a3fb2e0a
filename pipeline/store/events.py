"""Writing and reading raw events: the one transaction ingest relies on.

    write_batch(events, dead letters, next offsets)   -- one transaction, idempotent

Inserts are `INSERT .. ON CONFLICT DO NOTHING` on the natural keys (`event_id` for events,
`(source, partition, offset)` for dead letters), so a batch re-delivered after a crash, or a
replay of history, adds nothing that is already there. The consumer's next offsets are
upserted in the same transaction: after a crash, ingest seeks to exactly the position the
stored rows cover.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import Connection, Engine, Table, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite

from pipeline.store.tables import (
    EVENT_TABLES,
    consumer_offsets,
    dead_letters,
    feedback,
    interactions,
)
from pipeline.types import (
    DeadLetter,
    FeedbackEvent,
    InteractionEvent,
    SourcePosition,
)

# Rows per INSERT statement: below SQLite's 32k bound-parameter limit for the widest table.
_CHUNK = 500


def utcnow() -> datetime:
    """Naive UTC, the store's timestamp convention."""
    return datetime.now(timezone.utc).replace(tzinfo=None)


def _naive_utc(ts: datetime) -> datetime:
    return ts.astimezone(timezone.utc).replace(tzinfo=None)


@dataclass
class Positioned:
    """An event together with the log position it was read from."""

    event: InteractionEvent | FeedbackEvent
    position: SourcePosition


@dataclass
class WriteResult:
    inserted: dict[str, int] = field(default_factory=lambda: {"interaction": 0, "feedback": 0})
    duplicates: int = 0
    dead_letters: int = 0

    @property
    def events(self) -> int:
        return sum(self.inserted.values())


def event_row(item: Positioned, ingested_at: datetime) -> dict[str, Any]:
    """The row for one event: contract fields, unknown fields in `extra`, and provenance."""
    ev, pos = item.event, item.position
    row: dict[str, Any] = {
        "event_id": ev.event_id,
        "request_id": ev.request_id,
        "schema_version": ev.schema_version,
        "ts": _naive_utc(ev.ts),
        "extra": ev.extra or None,
        "source": pos.source,
        "partition": pos.partition,
        "offset": pos.offset,
        "ingested_at": ingested_at,
    }
    if isinstance(ev, InteractionEvent):
        row.update(
            session_id=ev.session_id,
            user_id=ev.user_id,
            tenant=ev.tenant,
            policy_version=ev.policy_version,
            prompt=ev.prompt,
            completion=ev.completion,
            completion_token_ids=ev.completion_token_ids,
            behavior_logprobs=ev.behavior_logprobs,
            sampling=ev.sampling,
            latency_ms=ev.latency_ms,
            metadata=ev.metadata,
        )
    else:
        row.update(
            kind=ev.kind,
            value=float(ev.value),
            value_is_bool=isinstance(ev.value, bool),
            payload=ev.payload,
        )
    return row


def dead_letter_row(dl: DeadLetter, created_at: datetime) -> dict[str, Any]:
    return {
        "source": dl.source,
        "partition": dl.partition,
        "offset": dl.offset,
        "reason": dl.reason.value,
        "detail": dl.detail[:4000],
        "raw": dl.raw,
        "created_at": created_at,
    }


def _insert_ignore(conn: Connection, table: Table, rows: Sequence[dict[str, Any]], key: list[str]) -> int:
    """INSERT .. ON CONFLICT DO NOTHING; returns how many rows were new."""
    dialect = sqlite if conn.dialect.name == "sqlite" else postgresql
    added = 0
    for start in range(0, len(rows), _CHUNK):
        chunk = rows[start : start + _CHUNK]
        stmt = dialect.insert(table).values(list(chunk)).on_conflict_do_nothing(index_elements=key)
        # RETURNING counts the rows really inserted on both dialects (rowcount is -1 on psycopg)
        added += len(conn.execute(stmt.returning(table.c[key[0]])).all())
    return added


def _upsert_offsets(conn: Connection, group_id: str, offsets: dict[tuple[str, int], int]) -> None:
    if not offsets:
        return
    dialect = sqlite if conn.dialect.name == "sqlite" else postgresql
    now = utcnow()
    rows = [
        {"group_id": group_id, "topic": t, "partition": p, "next_offset": o, "updated_at": now}
        for (t, p), o in sorted(offsets.items())
    ]
    stmt = dialect.insert(consumer_offsets).values(rows)
    stmt = stmt.on_conflict_do_update(
        index_elements=["group_id", "topic", "partition"],
        set_={"next_offset": stmt.excluded.next_offset, "updated_at": stmt.excluded.updated_at},
    )
    conn.execute(stmt)


def write_batch(
    engine: Engine,
    events: Iterable[Positioned],
    letters: Iterable[DeadLetter] = (),
    *,
    group_id: str | None = None,
    next_offsets: dict[tuple[str, int], int] | None = None,
) -> WriteResult:
    """Store events, dead letters and (optionally) the consumer's next offsets atomically."""
    now = utcnow()
    by_type: dict[str, list[dict[str, Any]]] = {"interaction": [], "feedback": []}
    for item in events:
        by_type[item.event.type].append(event_row(item, now))
    letter_rows = [dead_letter_row(dl, now) for dl in letters]
    result = WriteResult()
    with engine.begin() as conn:
        for kind, rows in by_type.items():
            result.inserted[kind] = _insert_ignore(conn, EVENT_TABLES[kind], rows, ["event_id"])
            result.duplicates += len(rows) - result.inserted[kind]
        result.dead_letters = _insert_ignore(
            conn, dead_letters, letter_rows, ["source", "partition", "offset"]
        )
        if group_id is not None and next_offsets:
            _upsert_offsets(conn, group_id, next_offsets)
    return result


def stored_offsets(engine: Engine, group_id: str, topics: Iterable[str] | None = None) -> dict[tuple[str, int], int]:
    """The next offset to read per (topic, partition) for a consumer group."""
    stmt = select(consumer_offsets.c.topic, consumer_offsets.c.partition, consumer_offsets.c.next_offset).where(
        consumer_offsets.c.group_id == group_id
    )
    if topics is not None:
        stmt = stmt.where(consumer_offsets.c.topic.in_(list(topics)))
    with engine.connect() as conn:
        return {(t, p): o for t, p, o in conn.execute(stmt)}


def existing_event_ids(engine: Engine, kind: str, event_ids: Sequence[str]) -> set[str]:
    table = EVENT_TABLES[kind]
    found: set[str] = set()
    with engine.connect() as conn:
        for start in range(0, len(event_ids), _CHUNK):
            chunk = list(event_ids[start : start + _CHUNK])
            found.update(conn.scalars(select(table.c.event_id).where(table.c.event_id.in_(chunk))))
    return found


def table_counts(engine: Engine) -> dict[str, int]:
    from pipeline.store.tables import metadata

    with engine.connect() as conn:
        return {
            name: conn.scalar(select(func.count()).select_from(table))
            for name, table in metadata.tables.items()
        }


def dead_letters_by_reason(engine: Engine) -> dict[str, int]:
    stmt = select(dead_letters.c.reason, func.count()).group_by(dead_letters.c.reason)
    with engine.connect() as conn:
        return dict(conn.execute(stmt).all())


# --- reading events back out (export) -------------------------------------------------------

def _iso(ts: datetime) -> str:
    return ts.replace(tzinfo=timezone.utc).isoformat().replace("+00:00", "Z")


_CONTRACT_COLUMNS = {
    "interaction": [
        "session_id", "user_id", "tenant", "policy_version", "prompt", "completion",
        "completion_token_ids", "behavior_logprobs", "sampling", "latency_ms", "metadata",
    ],
    "feedback": ["kind", "value", "payload"],
}


def row_to_event_dict(kind: str, row: Any) -> dict[str, Any]:
    """Rebuild the event JSON object from its row (unknown fields restored from `extra`)."""
    m = row._mapping
    out: dict[str, Any] = dict(m["extra"] or {})
    out.update(
        schema_version=m["schema_version"],
        event_id=m["event_id"],
        type=kind,
        ts=_iso(m["ts"]),
        request_id=m["request_id"],
    )
    for col in _CONTRACT_COLUMNS[kind]:
        value = m[col]
        if value is None:
            continue
        if col == "value":
            value = bool(value) if m["value_is_bool"] else (int(value) if value.is_integer() else value)
        out[col] = value
    return out


def iter_events(engine: Engine, batch: int = 1000) -> Iterator[dict[str, Any]]:
    """All stored events as contract dicts, interactions then feedback, in id order (streamed)."""
    for kind, table in (("interaction", interactions), ("feedback", feedback)):
        last_id = 0
        while True:
            stmt = select(table).where(table.c.id > last_id).order_by(table.c.id).limit(batch)
            with engine.connect() as conn:
                rows = conn.execute(stmt).all()
            if not rows:
                break
            for row in rows:
                yield row_to_event_dict(kind, row)
            last_id = rows[-1].id


def iter_dead_letters(engine: Engine, batch: int = 500) -> Iterator[Any]:
    last_id = 0
    while True:
        stmt = select(dead_letters).where(dead_letters.c.id > last_id).order_by(dead_letters.c.id).limit(batch)
        with engine.connect() as conn:
            rows = conn.execute(stmt).all()
        if not rows:
            return
        yield from rows
        last_id = rows[-1].id


def resolve_dead_letters(engine: Engine, fixed: Sequence[tuple[int, Positioned]]) -> WriteResult:
    """Store events recovered from dead letters and delete those letters, atomically."""
    now = utcnow()
    result = WriteResult()
    if not fixed:
        return result
    with engine.begin() as conn:
        for kind, table in EVENT_TABLES.items():
            rows = [event_row(p, now) for _, p in fixed if p.event.type == kind]
            result.inserted[kind] = _insert_ignore(conn, table, rows, ["event_id"])
            result.duplicates += len(rows) - result.inserted[kind]
        ids = [dl_id for dl_id, _ in fixed]
        for start in range(0, len(ids), _CHUNK):
            conn.execute(delete(dead_letters).where(dead_letters.c.id.in_(ids[start : start + _CHUNK])))
    return result
