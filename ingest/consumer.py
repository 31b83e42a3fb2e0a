"""Live ingest: a consumer-group member that stores every record exactly once.

    source     KafkaConsumer.poll()                   main process (owns the consumer)
    transform  decode_records() -> rows              } a lane: one worker process per lane,
    sink       write_rows(rows + next offsets)       } ONE transaction per batch
    commit     KafkaConsumer.commit(next offsets)     main process, after the DB commit

The commit order is the whole design: the store is the source of truth for positions. On
partition assignment the consumer seeks to the offsets stored in the DB, so a process killed
between the DB commit and the Kafka commit (or before either) resumes exactly where the store
is, and anything re-delivered is absorbed by the unique `event_id`.

The stages overlap: while lanes decode and store batch N, the main process fetches N+1. Each
partition belongs to one lane, which stores its batches in poll order (see workers.py).
Before partitions are revoked (rebalance) and on stop (SIGTERM/SIGINT), every batch in flight
is stored first, and on stop committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.errors import KafkaError
from kafka.structs import OffsetAndMetadata
from sqlalchemy import Engine

from ingest.batch import raw_records
from ingest.workers import Lanes
from pipeline.core import kafka_client
from pipeline.core.config import Config
from pipeline.core.store.event_reads import stored_offsets

log = logging.getLogger("rtrl.ingest")


@dataclass
class IngestStats:
    """Running totals, read by the progress display and returned at the end."""

    started: float = field(default_factory=time.monotonic)
    events: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    batches: int = 0
    # (topic, partition) -> records behind the high watermark, as of the last fetch
    lag: dict[tuple[str, int], int] = field(default_factory=dict)
    dead_by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return (self.events + self.dead_letters) / max(time.monotonic() - self.started, 1e-9)


class _SeekToStoredOffsets(ConsumerRebalanceListener):
    """On assignment, continue from the store's offsets, not from Kafka's committed ones."""

    # kafka-python 3 calls these on its network thread: they may block briefly (a DB read, the
    # lanes finishing their batches) but must not call back into the consumer's network API.

    def __init__(
        self,
        consumer: KafkaConsumer,
        engine: Engine,
        group_id: str,
        wait_stored: Callable[[], None],
        on_assigned: Callable[[], None],
        start: str = "earliest",
    ):
        self.consumer, self.engine, self.group_id = consumer, engine, group_id
        self.wait_stored, self.on_assigned, self.start = wait_stored, on_assigned, start

    def on_partitions_revoked(self, revoked):
        # Store every batch in flight while we still own its partitions, so the next owner
        # seeks to a position that covers them. (Their Kafka commit may then fail: harmless.)
        self.wait_stored()
        log.info("partitions revoked", extra={"partitions": sorted(map(tuple, revoked))})

    def on_partitions_assigned(self, assigned):
        offsets = stored_offsets(self.engine, self.group_id, {tp.topic for tp in assigned})
        fresh = [tp for tp in assigned if (tp.topic, tp.partition) not in offsets]
        for tp in assigned:
            if (tp.topic, tp.partition) in offsets:
                self.consumer.seek(tp, offsets[(tp.topic, tp.partition)])
        # no stored position: ingest.start, never Kafka's committed offset -- those belong to
        # whatever store the group fed before (a new or restored store would skip that history).
        # (Both seeks only mark the partition for an offset reset: no network call here.)
        if fresh:
            (self.consumer.seek_to_end if self.start == "latest" else self.consumer.seek_to_beginning)(*fresh)
        self.on_assigned()
        log.info(
            "partitions assigned",
            extra={
                "partitions": sorted(map(tuple, assigned)),
                "stored_offsets": len(offsets),
                "without_stored_offset": len(fresh),
                "start": self.start,
            },
        )


def make_consumer(cfg: Config, group_id: str | None, **overrides) -> KafkaConsumer:
    """A consumer that hands us raw bytes; offsets are managed by rtrl, never auto-committed.
    Raises kafka_client.KafkaAccessError (a KafkaError) naming the setting when it cannot connect."""
    params = dict(
        group_id=group_id,
        client_id=f"rtrl-{group_id or 'replay'}",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=cfg.ingest.batch_max_records,
        # a record up to max_event_bytes must fit one fetch, so it can be dead-lettered
        max_partition_fetch_bytes=max(1_048_576, cfg.ingest.max_event_bytes + 65_536),
        isolation_level="read_committed",
        session_timeout_ms=cfg.ingest.session_timeout_ms,
        heartbeat_interval_ms=max(cfg.ingest.session_timeout_ms // 3, 100),
    )
    params.update(overrides)
    return kafka_client.consumer(cfg.kafka_access, **params)


def run_ingest(
    cfg: Config,
    engine: Engine,
    stop: threading.Event,
    *,
    on_batch: Callable[[IngestStats], None] | None = None,
    max_records: int | None = None,
    idle_exit_s: float | None = None,
    until_caught_up: bool = False,
) -> IngestStats:
    """Consume until `stop` is set (or `max_records` stored, or idle for `idle_exit_s`, or --
    `until_caught_up` -- every record its partitions held when a fetch came back empty is stored)."""
    group_id, topics, icfg = cfg.ingest.group_id, cfg.ingest_topics, cfg.ingest
    consumer = make_consumer(cfg, group_id)
    lanes = Lanes(icfg.lanes, engine, group_id, icfg.max_event_bytes, icfg.max_in_flight)
    stats = IngestStats()
    # the idle clock starts when partitions are assigned: joining a group whose previous
    # member died waits for that member's session to time out, which is not idleness
    last_data = float("inf")

    def commit_stored(wait_all: bool = False) -> None:
        """Step 2 of the commit order: Kafka-commit what the lanes have stored."""
        for done in lanes.stored(wait_all):
            _commit_to_kafka(consumer, done.next_offsets)
            stats.batches += 1
            stats.events += done.result.events
            stats.duplicates += done.result.duplicates
            stats.dead_letters += done.result.dead_letters
            for reason, n in done.dead_by_reason.items():
                stats.dead_by_reason[reason] = stats.dead_by_reason.get(reason, 0) + n
            for (topic, part), nxt in done.next_offsets.items():
                high = consumer.highwater(TopicPartition(topic, part))
                if high is not None:
                    stats.lag[(topic, part)] = max(high - nxt, 0)
            if on_batch:
                on_batch(stats)

    def assigned() -> None:
        nonlocal last_data
        last_data = time.monotonic()
        if stats.batches == 0:
            stats.started = last_data  # rates count from the first assignment, not the join

    consumer.subscribe(
        topics, listener=_SeekToStoredOffsets(consumer, engine, group_id, lanes.wait_stored, assigned, start=icfg.start)
    )
    log.info("ingest started", extra={"group_id": group_id, "topics": topics, "lanes": icfg.lanes})
    clean = False
    try:
        while not stop.is_set():
            if max_records is not None and stats.events + stats.duplicates + stats.dead_letters >= max_records:
                break
            polled = consumer.poll(timeout_ms=icfg.poll_timeout_ms)
            records = [rec for part in polled.values() for rec in part]
            if records:
                last_data = time.monotonic()
                lanes.submit(raw_records(records))  # 1. decode + store, in the partition's lane
            commit_stored(wait_all=not records)  # 2. then commit to Kafka
            if not records and idle_exit_s is not None and time.monotonic() - last_data > idle_exit_s:
                break
            if not records and until_caught_up and _caught_up(consumer):  # the lanes were waited for above
                break
        commit_stored(wait_all=True)  # stop: store and commit everything in flight
        clean = True
    finally:
        consumer.close(autocommit=False)  # leaves the group; revocation waits for the lanes
        lanes.close(wait=clean)
        log.info(
            "ingest stopped",
            extra={
                "events": stats.events,
                "duplicates": stats.duplicates,
                "dead_letters": stats.dead_letters,
                "clean": clean,
            },
        )
    return stats


def _caught_up(consumer: KafkaConsumer) -> bool:
    """Whether this member has read every record its partitions hold now: its position is at
    each one's end offset (asked of the broker: a fetch's high watermark may be stale)."""
    assignment = list(consumer.assignment())
    if not assignment:
        return False  # not joined yet
    ends = consumer.end_offsets(assignment)
    return all(consumer.position(tp) >= ends[tp] for tp in assignment)


def _commit_to_kafka(consumer: KafkaConsumer, next_offsets: dict[tuple[str, int], int]) -> None:
    offsets = {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in next_offsets.items()}
    try:
        consumer.commit(offsets)
    except KafkaError as exc:
        # Safe to skip: positions are in the store, and a rebalance seeks to them.
        log.warning("kafka offset commit failed; the store keeps the position", extra={"error": repr(exc)})
