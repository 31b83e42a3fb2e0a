"""Storing lanes: decode and store batches in worker processes, partition-affine.

Decoding (JSON + contract validation) and storing (the insert and its fsync) cost more CPU
than fetching, and in one Python process they would share one GIL. So each *lane* is one
worker process that decodes a batch and stores it in one transaction with its next offsets;
the main process only fetches and commits to Kafka.

Ordering is what keeps offsets honest: a partition always goes to the same lane, and a lane
is one process working through its queue in order, so each partition's batches are stored in
the order they were polled and the stored position only moves forward. After a failure a
lane stores nothing more (a later batch would move the position past the failed one).

    lanes = 0  decode and store in the calling thread (same semantics, no processes)
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
import zlib
from collections import Counter, deque
from concurrent.futures import Future, ProcessPoolExecutor, wait
from dataclasses import dataclass

from sqlalchemy import Engine

from ingest.batch import RawRecord, decode_records
from pipeline.core.store.db import make_engine
from pipeline.core.store.events import WriteResult, write_rows


@dataclass
class StoredBatch:
    """What a lane reports back: enough for the Kafka commit and the progress display."""

    next_offsets: dict[tuple[str, int], int]
    result: WriteResult
    dead_by_reason: Counter
    records: int


class StoreFailed(RuntimeError):
    """An earlier batch of this lane failed to store; nothing after it is stored."""


# --- inside a lane ----------------------------------------------------------------------------

_lane: dict = {"engine": None, "failed": None}


def store_batch(records: list[RawRecord], max_event_bytes: int, group_id: str | None) -> StoredBatch:
    """Decode `records` and store rows + next offsets in one transaction (in a lane)."""
    if _lane["failed"] is not None:
        raise StoreFailed(f"not storing: an earlier batch failed ({_lane['failed']})")
    try:
        batch = decode_records(records, max_event_bytes)
        result = write_rows(_lane["engine"], batch.rows, group_id=group_id, next_offsets=batch.next_offsets)
    except BaseException as exc:
        _lane["failed"] = repr(exc)
        raise
    if result.refused:
        batch.dead_by_reason["store_refused"] += result.refused
    return StoredBatch(batch.next_offsets, result, batch.dead_by_reason, batch.records)


def _lane_init(parent_pid: int, db_url: str) -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the main process
    # alone decides when to stop, waits for what is in flight, then shuts the lanes down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _lane["engine"] = make_engine(db_url)

    # A main process killed with SIGKILL cannot shut us down: leave when it is gone (we are
    # then re-parented) instead of lingering as an orphan.
    def watch_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch_parent, name="rtrl-parent-watch", daemon=True).start()


# --- the main process's side -------------------------------------------------------------------


class _InlineLane:
    """lanes = 0: run in the calling thread, behind the interface of a one-process pool."""

    def __init__(self, engine: Engine):
        _lane.update(engine=engine, failed=None)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - delivered through the future, like a pool
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


class Lanes:
    """Routes each polled batch's records to their partition's lane; hands back stored batches
    in submission order."""

    def __init__(self, lanes: int, engine: Engine, group_id: str | None, max_event_bytes: int, max_in_flight: int):
        self.group_id, self.max_event_bytes = group_id, max_event_bytes
        self.max_pending = max_in_flight * max(lanes, 1)
        if lanes == 0:
            self._pools = [_InlineLane(engine)]
        else:
            # spawn: never fork a process that runs kafka-python's threads
            ctx = multiprocessing.get_context("spawn")
            url = engine.url.render_as_string(hide_password=False)
            self._pools = [
                ProcessPoolExecutor(1, mp_context=ctx, initializer=_lane_init, initargs=(os.getpid(), url))
                for _ in range(lanes)
            ]
        self._pending: deque[Future] = deque()

    def submit(self, records: list[RawRecord]) -> None:
        """Queue a polled batch; blocks while too many batches are in flight."""
        by_lane: dict[int, list[RawRecord]] = {}
        for rec in records:
            lane = zlib.crc32(f"{rec[0]}:{rec[1]}".encode()) % len(self._pools)
            by_lane.setdefault(lane, []).append(rec)
        for lane, recs in sorted(by_lane.items()):
            self._pending.append(self._pools[lane].submit(store_batch, recs, self.max_event_bytes, self.group_id))
        if len(self._pending) > self.max_pending:
            wait([self._pending[0]])  # the caller collects it with stored()

    def stored(self, wait_all: bool = False) -> list[StoredBatch]:
        """Batches stored since the last call, in submission order (raises if one failed)."""
        if wait_all:
            wait(list(self._pending))
        out = []
        while self._pending and self._pending[0].done():
            out.append(self._pending.popleft().result())
        return out

    def wait_stored(self) -> None:
        """Block until every batch in flight is stored or failed (their results stay queued)."""
        wait(list(self._pending))

    def close(self, wait: bool = True) -> None:
        for pool in self._pools:
            pool.shutdown(wait=wait, cancel_futures=not wait)
