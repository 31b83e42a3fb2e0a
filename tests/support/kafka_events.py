"""Events into Kafka and through ingest into the store, for the tests that need the broker."""

from __future__ import annotations

import threading

from kafka import KafkaProducer
from sqlalchemy import func, select

from ingest.consumer import run_ingest
from tests.support.factories import encode


def produce(
    bootstrap: str, topic: str, values: list[bytes], *, keys: list[bytes] | None = None, compression: str | None = None
) -> None:
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, compression_type=compression, linger_ms=5, max_request_size=4 << 20, acks="all"
    )
    for i, value in enumerate(values):
        producer.send(topic, value=value, key=keys[i] if keys else None)
    producer.flush()
    producer.close()


def produce_events(bootstrap: str, topics: dict[str, str], events: list[dict]) -> None:
    """Interaction and feedback events onto their topics, keyed by request id (as producers do)."""
    for kind, topic in (("interaction", topics["interactions"]), ("feedback", topics["feedback"])):
        batch = [e for e in events if e["type"] == kind]
        produce(bootstrap, topic, [encode(e) for e in batch], keys=[e["request_id"].encode() for e in batch])


def count(engine, table) -> int:
    with engine.connect() as conn:
        return conn.scalar(select(func.count()).select_from(table))


def ingest_until_caught_up(cfg, engine):
    """Ingest what the topics hold now, then return (idle_exit_s: a stall is a failure, not a wait)."""
    return run_ingest(cfg, engine, threading.Event(), until_caught_up=True, idle_exit_s=60)
