"""The two helpers that let ingest overlap its stages: decoder processes and an ordered writer.

    decoder_pool(n)   n processes running decode_records (CPU: JSON + contract validation);
                      n = 0 decodes inline behind the same submit() interface
    OrderedWriter     one thread that writes decoded batches strictly in submission order;
                      the store's commit (an fsync) releases the GIL, so fetching goes on

The Kafka commit is not done here: the consumer is not thread-safe, so written batches come
back through `OrderedWriter.written()` to the thread that owns it.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor

from sqlalchemy import Engine

from ingest.batch import DecodedBatch
from pipeline.store.events import WriteResult, write_rows


class InlineDecoder:
    """decode_workers = 0: decode in the calling thread, behind the interface of a pool."""

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - delivered through the future, like a pool
            future.set_exception(exc)
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def _decoder_init(parent_pid: int) -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group; the main process
    # alone decides when to stop, writes what is in flight, then shuts the decoders down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    # A main process killed with SIGKILL cannot shut us down: leave when it is gone (we are
    # then re-parented), instead of lingering as an orphan.
    def watch_parent() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch_parent, name="rtrl-parent-watch", daemon=True).start()


def decoder_pool(workers: int):
    if workers == 0:
        return InlineDecoder()
    # spawn: never fork a process that runs kafka-python's threads; workers are our children
    ctx = multiprocessing.get_context("spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_decoder_init,
                               initargs=(os.getpid(),))


class WriteFailed(RuntimeError):
    """A batch could not be stored; nothing after it was written (offsets never skip it)."""


class OrderedWriter:
    """Writes futures of DecodedBatch in submission order, on its own thread.

    After a failure it writes nothing more: a later batch's offsets would otherwise move the
    stored position past the failed one. `written()` then raises WriteFailed.
    """

    def __init__(self, engine: Engine, group_id: str | None, max_in_flight: int):
        self.engine, self.group_id = engine, group_id
        self._todo: queue.Queue[Future | None] = queue.Queue(maxsize=max_in_flight)
        self._done: queue.Queue[tuple[DecodedBatch, WriteResult]] = queue.Queue()
        self._failure: BaseException | None = None
        self.in_flight = 0  # submitted, not yet returned by written()
        self._thread = threading.Thread(target=self._run, name="rtrl-ingest-writer", daemon=True)
        self._thread.start()

    def submit(self, decoded: Future) -> None:
        """Queue a batch; blocks while `max_in_flight` batches wait to be written."""
        self.in_flight += 1
        self._todo.put(decoded)

    def _run(self) -> None:
        while True:
            decoded = self._todo.get()
            if decoded is None:
                self._todo.task_done()
                return
            try:
                if self._failure is None:
                    batch = decoded.result()
                    result = write_rows(self.engine, batch.rows, group_id=self.group_id,
                                        next_offsets=batch.next_offsets)
                    self._done.put((batch, result))
            except BaseException as exc:  # noqa: BLE001 - reported to the owner thread
                self._failure = exc
            finally:
                self._todo.task_done()

    def wait_stored(self) -> None:
        """Block until every submitted batch is stored (or the writer has failed)."""
        self._todo.join()

    def written(self, wait: bool = False) -> list[tuple[DecodedBatch, WriteResult]]:
        """Batches stored since the last call, in order; with `wait`, all that were submitted."""
        if wait:
            self.wait_stored()
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.in_flight -= len(out)
        if self._failure is not None:
            raise WriteFailed(f"storing a batch failed: {self._failure!r}") from self._failure
        return out

    def close(self) -> None:
        self._todo.put(None)
        self._thread.join()
