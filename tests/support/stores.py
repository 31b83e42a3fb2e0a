"""Events stored the way ingest stores them, and read back."""

from __future__ import annotations

import itertools

from sqlalchemy import select

from ingest.batch import decode_records
from pipeline.core.store.events import write_rows
from pipeline.core.store.tables import feedback, interactions
from tests.support.factories import encode


def event_contents(engine):
    """Event content, without provenance/ingestion columns (those differ by design)."""
    skip = {"id", "source", "partition", "offset", "ingested_at"}
    out = {}
    with engine.connect() as conn:
        for table in (interactions, feedback):
            for row in conn.execute(select(table).order_by(table.c.event_id)):
                out[row.event_id] = {k: v for k, v in row._mapping.items() if k not in skip}
    return out


_offsets = itertools.count(1)  # unique across calls: a source position names one record


def store(engine, *events, source: str = "t"):
    """Store `events` the way ingest does (encoded, decoded, written); returns the decoded batch."""
    batch = decode_records([(source, 0, next(_offsets), encode(ev)) for ev in events], 1 << 20)
    write_rows(engine, batch.rows)
    return batch
