"""Re-feeding history into the store, without disturbing the live consumer group.

    from Kafka   a group-less consumer assigned to every partition, from the first offset at
                 or after --since to the first offset at or after --until (or the end as of
                 the start of the replay); it never joins or commits for any group
    from a file  NDJSON(.gz) lines, each decoded exactly like a Kafka record
    dead letters stored letters decoded again (after a fix); those that pass become events
                 and their letters are deleted, in one transaction

All paths write with the same idempotent inserts as live ingest, so replaying twice changes
nothing. `dry_run` decodes and compares with the store but writes nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime

from kafka import TopicPartition
from sqlalchemy import Engine

from ingest.batch import DecodedBatch, RawRecord, decode_records, raw_records
from ingest.consumer import make_consumer
from ingest.decode import decode
from ingest.ndjson import iter_lines, source_name
from pipeline.core.config import Config
from pipeline.core.store.event_reads import existing_event_ids, iter_dead_letters
from pipeline.core.store.events import Rows, event_row, resolve_dead_letters, write_rows
from pipeline.core.types import DeadLetter, SourcePosition

_BATCH = 2000
_STALL_S = 60


@dataclass
class ReplayReport:
    read: int = 0
    new_events: dict[str, int] = field(default_factory=lambda: {"interaction": 0, "feedback": 0})
    already_stored: int = 0
    dead_letters: int = 0
    blank_lines: int = 0
    recovered: int = 0  # dead letters that now decode (with --dead-letters)
    still_dead: int = 0
    dry_run: bool = False

    def summary(self) -> str:
        verb = "would add" if self.dry_run else "added"
        parts = [
            f"read {self.read}",
            f"{verb} {self.new_events['interaction']} interactions and {self.new_events['feedback']} feedback",
            f"{self.already_stored} already stored",
            f"{self.dead_letters} dead letters",
        ]
        if self.blank_lines:
            parts.append(f"{self.blank_lines} blank lines skipped")
        if self.recovered or self.still_dead:
            parts.append(
                f"{'would recover' if self.dry_run else 'recovered'} {self.recovered} dead letters, "
                f"{self.still_dead} still failing"
            )
        return "; ".join(parts)


def _apply(engine: Engine, batch: DecodedBatch, report: ReplayReport) -> None:
    report.read += batch.records
    report.dead_letters += len(batch.rows.dead_letters)
    if report.dry_run:
        for kind in ("interaction", "feedback"):
            ids = [row["event_id"] for row in getattr(batch.rows, kind)]
            fresh = set(ids) - existing_event_ids(engine, kind, ids)
            report.new_events[kind] += len(fresh)
            report.already_stored += len(ids) - len(fresh)
        return
    result = write_rows(engine, batch.rows)  # no offsets: replay is not a group member
    for kind, n in result.inserted.items():
        report.new_events[kind] += n
    report.already_stored += result.duplicates


def _ms(ts: datetime) -> int:
    return int(ts.timestamp() * 1000)


def replay_from_kafka(
    cfg: Config,
    engine: Engine,
    since: datetime | None = None,
    until: datetime | None = None,
    topics: Iterable[str] | None = None,
    dry_run: bool = False,
    on_progress: Callable[[ReplayReport], None] | None = None,
) -> ReplayReport:
    """Replay records whose Kafka timestamp is in [since, until) from the given topics."""
    report = ReplayReport(dry_run=dry_run)
    consumer = make_consumer(cfg, group_id=None)
    try:
        tps = []
        for topic in topics or cfg.ingest_topics:
            for part in sorted(consumer.partitions_for_topic(topic) or ()):
                tps.append(TopicPartition(topic, part))
        if not tps:
            return report
        consumer.assign(tps)
        ends = consumer.end_offsets(tps)
        if until is not None:
            at_until = consumer.offsets_for_times({tp: _ms(until) for tp in tps})
            ends = {tp: (at_until[tp].offset if at_until.get(tp) else ends[tp]) for tp in tps}
        starts = consumer.beginning_offsets(tps)
        if since is not None:
            at_since = consumer.offsets_for_times({tp: _ms(since) for tp in tps})
            starts = {tp: (at_since[tp].offset if at_since.get(tp) else ends[tp]) for tp in tps}
        pending = {tp for tp in tps if starts[tp] < ends[tp]}
        for tp in tps:
            consumer.seek(tp, starts[tp])
        consumer.pause(*[tp for tp in tps if tp not in pending])
        last_progress = time.monotonic()
        while pending:
            polled = consumer.poll(timeout_ms=1000, max_records=_BATCH)
            records = [r for tp, recs in polled.items() for r in recs if r.offset < ends[tp]]
            for tp in list(pending):
                if consumer.position(tp) >= ends[tp]:
                    pending.discard(tp)
                    consumer.pause(tp)
            if polled:
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > _STALL_S:
                raise RuntimeError(
                    f"replay stalled: no records for {_STALL_S}s from {sorted(map(tuple, pending))}; "
                    "is the broker up (`rtrl kafka status`)?"
                )
            if records:
                _apply(engine, decode_records(raw_records(records), cfg.ingest.max_event_bytes), report)
                if on_progress:
                    on_progress(report)
    finally:
        consumer.close(autocommit=False)
    return report


def replay_from_file(
    cfg: Config,
    engine: Engine,
    path: str,
    dry_run: bool = False,
    on_progress: Callable[[ReplayReport], None] | None = None,
) -> ReplayReport:
    """Replay an NDJSON(.gz) file; dead letters name the file and the line number."""
    report = ReplayReport(dry_run=dry_run)
    source = source_name(path)
    chunk: list[RawRecord] = []

    def flush() -> None:
        if chunk:
            _apply(engine, decode_records(chunk, cfg.ingest.max_event_bytes), report)
            chunk.clear()
            if on_progress:
                on_progress(report)

    for lineno, line in iter_lines(path):
        if not line.strip():
            report.blank_lines += 1
            continue
        chunk.append((source, -1, lineno, line))
        if len(chunk) >= _BATCH:
            flush()
    flush()
    return report


def replay_dead_letters(cfg: Config, engine: Engine, dry_run: bool = False) -> ReplayReport:
    """Decode stored dead letters again; store those that pass and delete their letters."""
    report = ReplayReport(dry_run=dry_run)
    fixed, letter_ids = Rows(), []
    for row in iter_dead_letters(engine):
        report.read += 1
        pos = SourcePosition(source=row.source, partition=row.partition, offset=row.offset)
        result = decode(row.raw, pos, cfg.ingest.max_event_bytes)
        if isinstance(result, DeadLetter):
            report.still_dead += 1
            continue
        fixed.add_event(event_row(result, pos, row.raw.decode("utf-8")))
        letter_ids.append(row.id)
        report.new_events[result.type] += 1
    report.recovered = len(letter_ids)
    if not dry_run and letter_ids:
        written = resolve_dead_letters(engine, fixed, letter_ids)
        report.new_events = written.inserted
        report.already_stored += written.duplicates
    return report
