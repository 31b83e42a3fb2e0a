"""Kafka records -> (events, dead letters, next offsets): the transform between source and sink."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ingest.decode import decode
from pipeline.store.events import Positioned
from pipeline.types import DeadLetter, SourcePosition


@dataclass
class DecodedBatch:
    events: list[Positioned] = field(default_factory=list)
    letters: list[DeadLetter] = field(default_factory=list)
    # (topic, partition) -> offset of the next record to read, i.e. last offset + 1
    next_offsets: dict[tuple[str, int], int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.events) + len(self.letters)


def decode_records(records: Iterable[Any], max_event_bytes: int) -> DecodedBatch:
    """Decode kafka-python ConsumerRecords (anything with topic/partition/offset/value)."""
    batch = DecodedBatch()
    for rec in records:
        pos = SourcePosition(source=rec.topic, partition=rec.partition, offset=rec.offset)
        result = decode(rec.value, pos, max_event_bytes)
        if isinstance(result, DeadLetter):
            batch.letters.append(result)
        else:
            # decode() succeeded, so the value is valid UTF-8 JSON: stored verbatim
            batch.events.append(Positioned(result, pos, rec.value.decode("utf-8")))
        key = (rec.topic, rec.partition)
        batch.next_offsets[key] = max(batch.next_offsets.get(key, 0), rec.offset + 1)
    return batch
