"""Reading raw events back: the consumer's stored offsets, which event ids are stored, counts
per table and per dead-letter reason, the dead letters listed and shown (`rtrl dead-letters`),
and the bodies and dead letters in id order for export and replay (keyset pagination: each
chunk is one short query, so memory stays flat)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, Row, Select, func, select

from pipeline.core.store.events import count_of
from pipeline.core.store.tables import (
    EVENT_TABLES,
    consumer_offsets,
    dead_letters,
    feedback,
    interactions,
    metadata,
)

_CHUNK = 500  # ids per IN (...) query


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
    with engine.connect() as conn:
        return {
            name: count_of(conn, select(func.count()).select_from(table)) for name, table in metadata.tables.items()
        }


def dead_letters_by_reason(engine: Engine) -> dict[str, int]:
    stmt = select(dead_letters.c.reason, func.count()).group_by(dead_letters.c.reason)
    with engine.connect() as conn:
        return dict(conn.execute(stmt).all())


def iter_id_chunks(engine: Engine, stmt: Select, id_column: Any, size: int) -> Iterator[Sequence[Row]]:
    """Rows of `stmt` in chunks of `size`, in `id_column` order (keyset pagination: each chunk
    is one short query, so nothing is held open and memory stays flat)."""
    last_id = 0
    while True:
        with engine.connect() as conn:
            rows = conn.execute(stmt.where(id_column > last_id).order_by(id_column).limit(size)).all()
        if not rows:
            return
        yield rows
        last_id = getattr(rows[-1], id_column.key)


def iter_event_bodies(engine: Engine, batch: int = 1000) -> Iterator[str]:
    """Every stored event's JSON text, interactions then feedback, in id order (streamed)."""
    for table in (interactions, feedback):
        for rows in iter_id_chunks(engine, select(table.c.id, table.c.body), table.c.id, batch):
            yield from (row.body for row in rows)


def iter_dead_letters(engine: Engine, batch: int = 500) -> Iterator[Any]:
    for rows in iter_id_chunks(engine, select(dead_letters), dead_letters.c.id, batch):
        yield from rows


@dataclass(frozen=True)
class DeadLetterRecord:
    """A stored dead letter: where the record was in the log, why ingest set it aside, and its bytes."""

    id: int
    source: str  # the Kafka topic, or "file:<path>" for a replayed file (partition -1, offset: the line)
    partition: int
    offset: int
    reason: str  # a DeadLetterReason value (pipeline/core/types.py): malformed_json, oversized, ...
    detail: str  # what the decoder said
    size: int  # bytes of the raw record
    created_at: datetime
    raw: bytes | None = None  # the record as it was read; only dead_letter() reads it


def dead_letter_list(engine: Engine, reason: str | None = None, limit: int = 50) -> list[DeadLetterRecord]:
    """The newest `limit` dead letters (of `reason`, when given), newest first, without their bytes."""
    stmt = select(*[c for c in dead_letters.c if c.key != "raw"], func.length(dead_letters.c.raw).label("size"))
    if reason is not None:
        stmt = stmt.where(dead_letters.c.reason == reason)
    with engine.connect() as conn:
        rows = conn.execute(stmt.order_by(dead_letters.c.id.desc()).limit(limit)).all()
    return [_letter(row) for row in rows]


def dead_letter(engine: Engine, letter_id: int) -> DeadLetterRecord | None:
    """One dead letter with its raw bytes."""
    with engine.connect() as conn:
        row = conn.execute(select(dead_letters).where(dead_letters.c.id == letter_id)).first()
    return None if row is None else _letter(row, raw=bytes(row.raw))


def _letter(row: Any, raw: bytes | None = None) -> DeadLetterRecord:
    size = len(raw) if raw is not None else int(row.size)
    return DeadLetterRecord(
        row.id, row.source, row.partition, row.offset, row.reason, row.detail, size, row.created_at, raw
    )
