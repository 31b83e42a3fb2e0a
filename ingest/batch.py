"""Raw records -> insert-ready rows: the transform between source and sink.

`decode_records` is a pure function of plain tuples, so live ingest can run it in a decoder
process (see consumer.py) while the main process keeps fetching and writing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from ingest.decode import decode
from pipeline.core.store.events import Rows, dead_letter_row, event_row
from pipeline.core.types import DeadLetter, SourcePosition

RawRecord = tuple[str, int, int, bytes | None]
"""(topic or source, partition, offset, value) — what a Kafka record or a file line carries."""


@dataclass
class DecodedBatch:
    rows: Rows = field(default_factory=Rows)
    # (topic, partition) -> offset of the next record to read, i.e. last offset + 1
    next_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    dead_by_reason: Counter = field(default_factory=Counter)
    records: int = 0


def decode_records(records: Iterable[RawRecord], max_event_bytes: int) -> DecodedBatch:
    batch = DecodedBatch()
    for source, partition, offset, value in records:
        pos = SourcePosition(source=source, partition=partition, offset=offset)
        result = decode(value, pos, max_event_bytes)
        if isinstance(result, DeadLetter):
            batch.rows.dead_letters.append(dead_letter_row(result))
            batch.dead_by_reason[result.reason.value] += 1
        else:
            # decode() succeeded, so the value is valid UTF-8 JSON: stored verbatim
            batch.rows.add_event(event_row(result, pos, value.decode("utf-8")))
        key = (source, partition)
        batch.next_offsets[key] = max(batch.next_offsets.get(key, 0), offset + 1)
        batch.records += 1
    return batch


def raw_records(kafka_records: Iterable) -> list[RawRecord]:
    """kafka-python ConsumerRecords -> plain tuples (cheap to send to another process)."""
    return [(r.topic, r.partition, r.offset, r.value) for r in kafka_records]
