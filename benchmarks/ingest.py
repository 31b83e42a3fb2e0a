"""Ingest throughput on one topic of realistic events (~2 KB each), on a real local broker.

    (a) raw kafka-python consume, no processing        -- the ceiling
    (b) rtrl ingest -> SQLite                           -- decode, validate, store, commit
    (c) rtrl ingest -> PostgreSQL                       -- needs RTRL_TEST_POSTGRES (admin URL)
    (d) naive: one ORM row per message, commit per message (first 10k events only)
    (e) two `rtrl ingest` processes in one consumer group -> PostgreSQL, their sum
    decode: the decoder alone on one core, the reference (orjson + pydantic) and ingest's
            fast path (orjson + msgspec, pipeline/core/decoded.py), microseconds per event

Each phase runs in its own child process so its peak RSS is its own (for rtrl: the consumer
process plus its lane). Prints events/s, the ratios b/a, c/a, b/d, and peak RSS.

    .venv/bin/python benchmarks/ingest.py --events 200000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import resource
import shutil
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kafka import KafkaConsumer, KafkaProducer, TopicPartition  # noqa: E402
from sqlalchemy import create_engine  # noqa: E402
from sqlalchemy.orm import Session, declarative_base  # noqa: E402

from ingest.consumer import run_ingest  # noqa: E402
from pipeline import kafka_local  # noqa: E402
from pipeline.core.config import Config, load_config  # noqa: E402
from pipeline.core.store import db as store_db  # noqa: E402
from pipeline.core.store.tables import interactions  # noqa: E402
from tests.support.factories import encode, interaction  # noqa: E402
from tests.support.scratch_db import scratch_database  # noqa: E402

PARTITIONS = 4


def peak_rss_mb() -> float:
    """Peak RSS of this process plus its largest finished child (an ingest lane), in MB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    child = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + child) / 1024


def produce(bootstrap: str, topic: str, n: int) -> int:
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, linger_ms=20, batch_size=512 * 1024, compression_type="lz4", acks=1
    )
    size = 0
    template = [encode(interaction(i, prefix="b", size=2048)) for i in range(1000)]
    for i in range(n):
        # unique event ids, realistic 2 KB bodies
        value = template[i % 1000].replace(b'"b-i-', f'"b{i // 1000}-i-'.encode(), 1)
        size += len(value)
        producer.send(topic, value=value, key=str(i).encode())
    producer.flush()
    producer.close()
    return size // n


def phase_raw(bootstrap: str, topic: str, n: int, q) -> None:
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, max_poll_records=2000
    )
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    seen, start = 0, time.monotonic()
    while seen < n:
        for recs in consumer.poll(timeout_ms=1000).values():
            seen += len(recs)
    q.put((seen / (time.monotonic() - start), peak_rss_mb()))
    consumer.close()


def phase_rtrl(cfg: Config, n: int, q) -> None:
    """Clock: from partition assignment (the group join is not throughput) to the batch
    that stores the n-th event."""
    engine = store_db.make_engine(cfg.db_url)
    end = {}

    def on_batch(stats):
        end["t"] = time.monotonic()

    stats = run_ingest(cfg, engine, threading.Event(), on_batch=on_batch, max_records=n)
    assert stats.events == n, f"stored {stats.events} of {n}"
    q.put((n / (end["t"] - stats.started), peak_rss_mb()))


def phase_group_member(cfg: Config, stop, counts) -> None:
    """One of two ingest processes of one consumer group: reports its stored events per batch."""
    engine = store_db.make_engine(cfg.db_url)
    run_ingest(cfg, engine, stop, on_batch=lambda stats: counts.put((os.getpid(), time.monotonic(), stats.events)))


def phase_group(cfg: Config, n: int) -> float:
    """Two members in one group: from the first member's first stored batch's clock start (its
    join; the second member's join rebalances the group, a real cost of scaling out) to the
    batch that brings the sum to n."""
    ctx = mp.get_context("fork")
    stop, counts = ctx.Event(), ctx.Queue()
    start = time.monotonic()
    members = [ctx.Process(target=phase_group_member, args=(cfg, stop, counts)) for _ in range(2)]
    for member in members:
        member.start()
    stored: dict[int, int] = {}
    while sum(stored.values()) < n:
        try:
            pid, at, events = counts.get(timeout=60)
        except queue.Empty:
            raise RuntimeError(f"the group stalled at {sum(stored.values())} of {n} events") from None
        stored[pid] = events
    stop.set()
    for member in members:
        member.join(timeout=60)
    return n / (at - start)


def decode_costs(n: int = 4000) -> tuple[float, float]:
    """(reference, fast path) microseconds per event on one core, the best of three passes."""
    from ingest.decode import decode_fast, decode_reference
    from pipeline.core.types import SourcePosition

    records = [encode(interaction(i, prefix="b", size=2048)) for i in range(n)]
    pos = SourcePosition(source="bench", partition=0, offset=0)
    out = []
    for fn in (lambda raw: decode_reference(raw, pos, 1 << 20), decode_fast):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for raw in records:
                fn(raw)
            best = min(best, (time.perf_counter() - start) / n * 1e6)
        out.append(best)
    return out[0], out[1]


Base = declarative_base()


class NaiveInteraction(Base):
    __table__ = interactions


def phase_naive(bootstrap: str, topic: str, db_url: str, n: int, q) -> None:
    """The loop most teams write first: ORM object per message, commit per message."""
    from datetime import datetime

    engine = create_engine(db_url)
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"naive-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    seen, start = 0, time.perf_counter()
    with Session(engine) as session:
        for msg in consumer:
            ev = json.loads(msg.value)
            row = NaiveInteraction(
                event_id=ev["event_id"],
                request_id=ev["request_id"],
                schema_version=ev["schema_version"],
                ts=datetime.fromisoformat(ev["ts"].replace("Z", "+00:00")).replace(tzinfo=None),
                session_id=ev["session_id"],
                user_id=ev["user_id"],
                tenant=ev["tenant"],
                policy_version=ev["policy_version"],
                body=msg.value.decode(),
                source=msg.topic,
                partition=msg.partition,
                offset=msg.offset,
                ingested_at=datetime.utcnow(),
                # the columns migration 0008 made required: the text written, and whether an
                # answer was expected (the naive loop takes them as they come)
                output_text=ev["completion"] if isinstance(ev["completion"], str) else json.dumps(ev["completion"]),
                expects_attempt=True,
            )
            session.add(row)
            session.commit()
            consumer.commit()
            seen += 1
            if seen >= n:
                break
    q.put((seen / (time.perf_counter() - start), peak_rss_mb()))
    consumer.close()


def run_phase(target, *args):
    """Run one phase in a forked child; its result is (events/s, peak RSS MB)."""
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, q))
    proc.start()
    while True:
        try:
            result = q.get(timeout=1)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"{target.__name__} died with exit code {proc.exitcode}") from None
    proc.join()
    return result


def postgres_db(admin_url: str) -> str:
    url, _ = scratch_database(admin_url, f"rtrl_bench_{uuid.uuid4().hex[:8]}")
    return url


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--naive-events", type=int, default=10_000)
    ap.add_argument("--group", action="store_true", help="also (e): two ingest processes in one group (PostgreSQL)")
    ap.add_argument("--lanes", type=int, default=None, help="ingest.lanes (default: the config default)")
    ap.add_argument(
        "--bootstrap",
        default=os.environ.get("RTRL_KAFKA_BOOTSTRAP"),
        help="an existing broker; default: start one under a temporary folder",
    )
    args = ap.parse_args()
    reference, fast = decode_costs()
    print(f"decode, one core: reference {reference:.1f} us/event, fast path {fast:.1f} us/event")
    tmp = Path(tempfile.mkdtemp(prefix="rtrl-bench-"))
    broker_cfg = None
    bootstrap = args.bootstrap
    if not bootstrap:
        broker_cfg = Config(state_dir=tmp / "state")
        broker_cfg.kafka.port, broker_cfg.kafka.controller_port = 29092, 29093
        bootstrap = kafka_local.up(broker_cfg, progress=print).bootstrap
    try:
        topic = f"bench-{uuid.uuid4().hex[:6]}"
        kafka_local.ensure_topics(bootstrap, [topic], PARTITIONS)
        t = time.perf_counter()
        avg = produce(bootstrap, topic, args.events)
        print(f"produced {args.events} events, {avg} bytes each, in {time.perf_counter() - t:.1f}s")

        results = {}
        results["a"] = run_phase(phase_raw, bootstrap, topic, args.events)
        print(f"(a) raw kafka-python consume: {results['a'][0]:10,.0f} events/s  peak RSS {results['a'][1]:.0f} MB")

        def rtrl_cfg(db_url: str) -> Config:
            store_db.upgrade(db_url)
            env = {
                "RTRL_DB_URL": db_url,
                "RTRL_KAFKA_BOOTSTRAP": bootstrap,
                "RTRL_INGEST__TOPICS": topic,
                "RTRL_INGEST__GROUP_ID": f"bench-{uuid.uuid4().hex[:6]}",
                "RTRL_STATE_DIR": str(tmp),
            }
            if args.lanes is not None:
                env["RTRL_INGEST__LANES"] = str(args.lanes)
            return load_config(environ=env)

        results["b"] = run_phase(phase_rtrl, rtrl_cfg(f"sqlite:///{tmp / 'b.db'}"), args.events)
        print(f"(b) rtrl ingest -> SQLite:    {results['b'][0]:10,.0f} events/s  peak RSS {results['b'][1]:.0f} MB")
        pg = os.environ.get("RTRL_TEST_POSTGRES")
        if pg:
            results["c"] = run_phase(phase_rtrl, rtrl_cfg(postgres_db(pg)), args.events)
            print(f"(c) rtrl ingest -> PostgreSQL:{results['c'][0]:10,.0f} events/s  peak RSS {results['c'][1]:.0f} MB")
            if args.group:
                results["e"] = (phase_group(rtrl_cfg(postgres_db(pg)), args.events), 0.0)
                print(f"(e) 2 ingest processes -> PostgreSQL: {results['e'][0]:10,.0f} events/s (their sum)")
        else:
            print("(c) skipped: set RTRL_TEST_POSTGRES to an admin URL")
        naive_url = f"sqlite:///{tmp / 'd.db'}"
        store_db.upgrade(naive_url)
        results["d"] = run_phase(phase_naive, bootstrap, topic, naive_url, min(args.naive_events, args.events))
        print(f"(d) naive ORM, commit/message:{results['d'][0]:10,.0f} events/s  peak RSS {results['d'][1]:.0f} MB")
        a, b, d = results["a"][0], results["b"][0], results["d"][0]
        print(f"b/a = {b / a:.2f}   (target >= 0.40)")
        if "c" in results:
            print(f"c/a = {results['c'][0] / a:.2f}   (target >= 0.40)")
        if "e" in results:
            print(f"e/a = {results['e'][0] / a:.2f}")
        print(f"b/d = {b / d:.1f}   (target >= 10)")
    finally:
        if broker_cfg is not None:
            kafka_local.down(broker_cfg)
        shutil.rmtree(tmp, ignore_errors=True)  # the stores and the broker's logs: gigabytes


if __name__ == "__main__":
    main()
