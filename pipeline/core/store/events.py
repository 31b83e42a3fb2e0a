"""Writing and reading raw events: the one transaction ingest relies on.

    event_row / dead_letter_row      pure: an event or dead letter -> an insert-ready dict
    output_columns                   pure: what the policy wrote -> an interaction's columns
    write_rows(rows, next offsets)   one transaction, idempotent; a row the store refuses
                                     becomes a dead letter (store_refused), never a failed batch

Rows are plain dicts so that they can be built anywhere (ingest builds them in its worker
processes) and written here.

Inserts are `INSERT .. ON CONFLICT DO NOTHING` on the natural keys (`event_id` for events,
`(source, partition, offset)` for dead letters), so a batch re-delivered after a crash, or a
replay of history, adds nothing that is already there (store/inserts.py: the driver's
executemany of one compiled statement, and on PostgreSQL, for a batch's events, one binary COPY
into a staging table). The consumer's next offsets are upserted in the same transaction: after a
crash, ingest seeks to exactly the position the stored rows cover. Reading events back out is
store/event_reads.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson
from sqlalchemy import Connection, Engine, Select, delete
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DataError, IntegrityError

from pipeline.core.decoded import DecodedEvent, DecodedInteraction
from pipeline.core.store.inserts import (
    copy_insert_ignore,
    insert_ignore,
    may_stage,
)
from pipeline.core.store.tables import (
    EVENT_TABLES,
    consumer_offsets,
    dead_letters,
)
from pipeline.core.types import (
    DeadLetter,
    DeadLetterReason,
    SourcePosition,
    completion_parts,
    expects_attempt,
)

_CHUNK = 500  # ids per IN (...) query
log = logging.getLogger("rtrl.store")


def utcnow() -> datetime:
    """Naive UTC, the store's timestamp convention."""
    return datetime.now(UTC).replace(tzinfo=None)


def count_of(conn: Connection, stmt: Select) -> int:
    """The value of a `SELECT count(...)`: never NULL, though `scalar()` is typed as if it could be."""
    return conn.scalar(stmt) or 0


@dataclass
class Rows:
    """Insert-ready rows of one batch, by table. Built by `event_row` / `dead_letter_row`."""

    interaction: list[dict[str, Any]] = field(default_factory=list)
    feedback: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)

    def add_event(self, row: dict[str, Any]) -> None:
        getattr(self, row["type"]).append(row)

    def __len__(self) -> int:
        return len(self.interaction) + len(self.feedback) + len(self.dead_letters)


@dataclass
class WriteResult:
    inserted: dict[str, int] = field(default_factory=lambda: {"interaction": 0, "feedback": 0})
    duplicates: int = 0
    dead_letters: int = 0
    refused: int = 0  # events the store refused, written as dead letters (among `dead_letters`)

    @property
    def events(self) -> int:
        return sum(self.inserted.values())


def event_row(ev: DecodedEvent, pos: SourcePosition, body: str) -> dict[str, Any]:
    """The row for one event as ingest decoded it (pipeline/core/decoded.py): the body
    verbatim, the fields stages query, and provenance.
    `type` routes the row to its table; it is not a column."""
    row: dict[str, Any] = {
        "type": ev.type,
        "event_id": ev.event_id,
        "request_id": ev.request_id,
        "episode_id": ev.episode_id,
        "schema_version": ev.schema_version,
        "ts": ev.ts.replace(tzinfo=None),  # UTC already: the decoded structs normalise it
        "body": body,
        "source": pos.source,
        "partition": pos.partition,
        "offset": pos.offset,
    }
    if isinstance(ev, DecodedInteraction):
        row.update(
            session_id=ev.session_id,
            user_id=ev.user_id,
            tenant=ev.tenant,
            policy_version=ev.policy_version,
            step=ev.step,
            **output_columns(ev.completion, ev.metadata, ev.tool_calls),
        )
    else:
        row.update(kind=ev.kind, value=float(ev.value), tenant=ev.tenant)
    return row


def output_columns(completion: Any, metadata: Any, tool_calls: list | None = None) -> dict[str, Any]:
    """An interaction's columns of what the policy wrote (see tables.interactions), from its
    `completion`, `metadata` and `tool_calls` (a server's parse of a text completion) as in the
    event. PostgreSQL text cannot hold NUL: one in the
    text is stored as U+FFFD on every backend (the body, JSON text, keeps it as the `\u0000`
    escape it arrived as); tool calls are JSON text, where it is escaped anyway."""
    text, calls = completion_parts(completion)
    calls = (*calls, *(tool_calls or ()))
    return {
        "output_text": text.replace("\x00", "\ufffd") if "\x00" in text else text,
        "output_tool_calls": _json_text(calls) if calls else None,
        "expects_attempt": expects_attempt(metadata),
    }


def _json_text(value: Any) -> str:
    try:
        return orjson.dumps(value).decode()
    except orjson.JSONEncodeError:  # an integer beyond 64 bits (ingest's decoder keeps them exact)
        return json.dumps(value, ensure_ascii=False)


def dead_letter_row(dl: DeadLetter) -> dict[str, Any]:
    # the detail may quote the bad input (a `type` value, say): NUL written as \x00 (see above)
    return {
        "source": dl.source,
        "partition": dl.partition,
        "offset": dl.offset,
        "reason": dl.reason.value,
        "detail": dl.detail[:4000].replace("\x00", "\\x00"),
        "raw": dl.raw,
    }


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


def _write_events(conn: Connection, rows: Rows, now: datetime, result: WriteResult) -> None:
    insert = copy_insert_ignore if conn.dialect.name == "postgresql" and may_stage(conn) else insert_ignore
    for kind, table in EVENT_TABLES.items():
        batch = getattr(rows, kind)
        added = insert(conn, table, batch, ["event_id"], same={"ingested_at": now})
        result.inserted[kind] += added
        result.duplicates += len(batch) - added


def write_rows(
    engine: Engine,
    rows: Rows,
    *,
    group_id: str | None = None,
    next_offsets: dict[tuple[str, int], int] | None = None,
) -> WriteResult:
    """Store a batch's events, dead letters and (optionally) the consumer's next offsets in
    one transaction. Rows already stored (same event_id / log position) are skipped.

    An event the store refuses (a value it cannot hold that the contract let through, a trigger
    or constraint of the operator's) would fail the batch's transaction at every retry and halt
    ingest at that offset for good. So a batch refused for its data is written again with each
    such event as a dead letter (`store_refused`, the store's message as the detail): the other
    events and the offsets commit, the refused one can be replayed once the cause is fixed. The
    store being away (OperationalError) is not a refusal: it propagates, and ingest retries."""
    try:
        return _write_rows(engine, rows, group_id, next_offsets)
    except (DataError, IntegrityError) as exc:
        kept, refused = _split_refused(engine, rows)
        if not refused:
            raise  # not one event on its own: a fault of the batch, not of a record
        log.warning(
            "events the store refused are dead letters",
            extra={"refused": len(refused), "error": f"{type(exc.orig).__name__}: {exc.orig}"[:500]},
        )
        kept.dead_letters.extend(refused)
        result = _write_rows(engine, kept, group_id, next_offsets)
        result.refused = len(refused)
        return result


def _split_refused(engine: Engine, rows: Rows) -> tuple[Rows, list[dict[str, Any]]]:
    """Each event tried on its own (and rolled back): (the ones the store takes, dead-letter
    rows of the ones it refuses). Only on the failure path: a transaction per event."""
    kept, refused = Rows(dead_letters=list(rows.dead_letters)), []
    for kind, table in EVENT_TABLES.items():
        for row in getattr(rows, kind):
            with engine.connect() as conn:
                trial = conn.begin()
                try:
                    insert_ignore(conn, table, [row], ["event_id"], same={"ingested_at": utcnow()})
                except (DataError, IntegrityError) as exc:
                    refused.append(
                        dead_letter_row(
                            DeadLetter(
                                reason=DeadLetterReason.STORE_REFUSED,
                                detail=f"the store refused the event: {exc.orig}"[:2000],
                                raw=row["body"].encode("utf-8", "surrogatepass"),
                                source=row["source"],
                                partition=row["partition"],
                                offset=row["offset"],
                            )
                        )
                    )
                    continue
                finally:
                    trial.rollback()
            kept.add_event(row)
    return kept, refused


def _write_rows(
    engine: Engine, rows: Rows, group_id: str | None, next_offsets: dict[tuple[str, int], int] | None
) -> WriteResult:
    now = utcnow()
    result = WriteResult()
    with engine.begin() as conn:
        _write_events(conn, rows, now, result)
        result.dead_letters = insert_ignore(
            conn, dead_letters, rows.dead_letters, ["source", "partition", "offset"], same={"created_at": now}
        )
        if group_id is not None and next_offsets:
            _upsert_offsets(conn, group_id, next_offsets)
    return result


def resolve_dead_letters(engine: Engine, rows: Rows, letter_ids: Sequence[int]) -> WriteResult:
    """Store events recovered from dead letters and delete those letters, atomically."""
    result = WriteResult()
    with engine.begin() as conn:
        _write_events(conn, rows, utcnow(), result)
        for start in range(0, len(letter_ids), _CHUNK):
            chunk = list(letter_ids[start : start + _CHUNK])
            conn.execute(delete(dead_letters).where(dead_letters.c.id.in_(chunk)))
    return result
