"""Lag per partition: the broker's end offsets against the positions stored for the group."""

from __future__ import annotations

from dataclasses import dataclass

from kafka import TopicPartition
from kafka.errors import KafkaError
from sqlalchemy import Engine

from ingest.consumer import make_consumer
from pipeline.core.config import Config
from pipeline.core.store.event_reads import stored_offsets


@dataclass(frozen=True)
class PartitionLag:
    topic: str
    partition: int
    stored: int | None  # next offset the store covers; None = never consumed
    end: int

    @property
    def lag(self) -> int:
        return self.end - (self.stored or 0)


def partition_lag(cfg: Config, engine: Engine, timeout_ms: int = 10_000) -> list[PartitionLag]:
    """Raises KafkaError (e.g. NoBrokersAvailable) when the broker cannot be reached."""
    consumer = make_consumer(cfg, group_id=None, request_timeout_ms=timeout_ms + 1000)
    try:
        tps = [TopicPartition(t, p) for t in cfg.ingest_topics for p in sorted(consumer.partitions_for_topic(t) or ())]
        ends = consumer.end_offsets(tps, timeout_ms=timeout_ms) if tps else {}
    finally:
        consumer.close(autocommit=False)
    stored = stored_offsets(engine, cfg.ingest.group_id, cfg.ingest_topics)
    return [PartitionLag(tp.topic, tp.partition, stored.get((tp.topic, tp.partition)), ends[tp]) for tp in tps]


__all__ = ["PartitionLag", "partition_lag", "KafkaError"]
