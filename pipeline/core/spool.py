"""A local spool for events the broker did not acknowledge: nothing a producer accepted is lost
while Kafka is away, and what waits is sent in order once it is back.

    append   a record (topic, key, value) is written to the open segment file (the OS has it
             once append returns: a process killed, kill -9 included, loses nothing appended); a
             committer thread fsyncs the segment every `commit_s` (group commit: a machine that
             goes down loses at most the records of the last interval)
    drain    the records, oldest first, to `send` (which returns once the broker acknowledged);
             the position reached is saved (fsynced) after each batch, a segment sent whole is
             deleted. A crash between a send and the saved position sends those records again:
             the ingest side drops the duplicates by event id (exactly once after dedupe)
    full     the spool holds at most `max_bytes`; past that an append is refused (SpoolFull:
             the caller counts and logs it) or, with `when_full = "block"`, waits for
             the drain to make room -- never a silent drop
    set aside  a record the broker refuses for good (`permanent(error)`: too large for the
             topic) would otherwise stop every record behind it: it is written to
             `<dir>/set-aside.jsonl` (fsynced, with the error), counted (`set_aside`), logged,
             and the drain goes on (refused among others in flight: BatchRefused, and the
             caller drains again one record at a time)

One process owns a spool directory: it holds an exclusive lock on `<dir>/lock` while open
(released by the OS when it dies, kill -9 included); a second opener gets SpoolBusy at once
instead of two writers interleaving records and positions.

On disk: `<dir>/<segment:012d>.spool`, each record `[4-byte length][4-byte crc32][payload]`
(payload: JSON {"topic", "key", "value"}); `<dir>/position` holds "<segment> <offset>". A
record torn by a crash (short, or failing its checksum) ends its segment: it and what follows
are dropped with a log line (nothing after it was acknowledged to the caller as durable).

Standard library only.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("rtrl.spool")
_HEAD = struct.Struct(">II")  # length, crc32


class SpoolFull(RuntimeError):
    """The spool is at max_bytes and refuses new records (`when_full = "refuse"`)."""


class BatchRefused(RuntimeError):
    """Records in flight together were refused for good, and which of them is at fault is not
    known: drain again one record at a time (batch=1) to set aside only that one."""


class SpoolBusy(RuntimeError):
    """Another process (or another open Spool) holds this spool directory."""


class Spool:
    def __init__(
        self,
        directory: Path,
        max_bytes: int = 1 << 30,
        when_full: Literal["refuse", "block"] = "refuse",
        commit_s: float = 0.05,
        segment_bytes: int = 16 << 20,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.lockfile = open(self.dir / "lock", "a+")
        try:
            fcntl.flock(self.lockfile, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.lockfile.close()
            raise SpoolBusy(
                f"the spool under {self.dir} is in use by another process: give each process "
                "(each gateway port, each application worker) its own spool directory"
            ) from None
        self.max_bytes, self.when_full = max_bytes, when_full
        self.owner = os.getpid()  # a child forked from this process holds the same lock, not its own
        self.commit_s, self.segment_bytes = commit_s, segment_bytes
        self.lock = threading.Condition()
        self.refused = 0
        self.set_aside = 0  # records the broker refused for good, kept in set-aside.jsonl
        self.waiting = 0  # appends waiting for room ("block")
        seg, off = self._position()
        for sent in (s for s in self._segments() if s < seg):  # sent whole before a crash removed it
            self._path(sent).unlink()
        segments = self._segments()
        # kept in memory, not read from the disk on every append (serving appends per request):
        # the bytes the segments hold, and how many of the oldest segment's were sent already
        self.bytes = sum(self._path(s).stat().st_size for s in segments)
        self.sent_offset = off if seg in segments else 0
        self.segment = (segments[-1] + 1) if segments else 0  # never append to a segment a crash may have torn
        self.file = open(self._path(self.segment), "ab")
        self.dirty = False
        self.closed = False
        self.committer = threading.Thread(target=self._commit_loop, name="spool-commit", daemon=True)
        self.committer.start()

    # -- appending --------------------------------------------------------------------------

    def check_owner(self) -> None:
        """SpoolBusy in a process forked after the spool was opened: the lock came along with the
        fork (both would append to one segment, and the child has no thread to send it)."""
        if os.getpid() != self.owner:
            raise SpoolBusy(
                f"the spool under {self.dir} was opened by process {self.owner} before it forked: "
                "open one in each worker after the fork (a pre-forking server: in its post-fork hook)"
            )

    def append(self, topic: str, key: bytes | None, value: bytes) -> None:
        """Keep a record until drain() sends it; SpoolFull when the spool is full and refuses."""
        self.check_owner()
        payload = json.dumps(
            {"topic": topic, "key": key.decode() if key is not None else None, "value": value.decode()}
        ).encode()
        record = _HEAD.pack(len(payload), zlib.crc32(payload)) + payload
        with self.lock:
            while self.size() + len(record) > self.max_bytes:
                if self.when_full == "refuse":
                    self.refused += 1
                    raise SpoolFull(
                        f"the spool under {self.dir} holds {self.size()} bytes (max {self.max_bytes}); "
                        "the broker has been away too long: raise spool.max_bytes or bring it back"
                    )
                self.waiting += 1
                try:
                    self.lock.wait(timeout=1.0)  # "block": until a drain makes room
                finally:
                    self.waiting -= 1
            if self.file.tell() + len(record) > self.segment_bytes and self.file.tell() > 0:
                self._roll()
            self.file.write(record)
            self.file.flush()  # to the OS: a record in Python's buffer would die with the process
            self.bytes += len(record)
            self.dirty = True

    def size(self) -> int:
        """Bytes the spool holds (a segment's sent records included, until it is sent whole)."""
        return self.bytes

    def pending(self) -> bool:
        """Whether anything waits to be sent."""
        return self.bytes > self.sent_offset

    # -- draining ----------------------------------------------------------------------------

    def drain(
        self,
        send: Callable[[str, bytes | None, bytes], Any],
        batch: int = 500,
        permanent: Callable[[Exception], bool] = lambda exc: False,
        on_set_aside: Callable[[], None] = lambda: None,
    ) -> int:
        """Send every waiting record in order; returns how many were sent. `send` may return a
        future (anything with `.get()`): the records of a batch are then in flight together,
        and the position is saved only once every one of them is acknowledged. A send (or a
        future) that raises stops the drain there (the batch stays first in line: records of
        it that did arrive arrive again, duplicates ingest drops); the caller retries later --
        unless `permanent(error)`: that record is set aside and the drain goes on -- after
        `on_set_aside()` where the broker refused it (a producer that had a record refused fails
        every later one: the caller makes a new one)."""
        sent = 0
        with self.lock:
            full = self._swap() if self.file.tell() > 0 else None  # appends go to a new segment from now on
            segments = [s for s in self._segments() if s != self.segment]
        if full is not None:  # (outside the lock: an append never waits on a disk flush)
            _fsync_and_close(full)
            _fsync_dir(self.dir)
        seg, off = self._position()
        for s in segments:
            start = off if s == seg else 0
            done, in_flight = 0, []
            for end, record in self._records(s, start):
                try:
                    future = send(*record)
                except Exception as exc:  # noqa: BLE001 - refused before it left (too large): aside, or stop
                    self._refused(record, exc, permanent)  # (the producer never sent it: still sound)
                    future = None
                if future is not None:
                    in_flight.append((future, record))
                sent, done = sent + 1, done + 1
                if done % batch == 0:
                    self._settle(in_flight, permanent, on_set_aside)
                    self._save_position(s, end)
                    self.sent_offset = end
            self._settle(in_flight, permanent, on_set_aside)
            self._save_position(s + 1, 0)
            length = self._length(s)
            self._path(s).unlink(missing_ok=True)
            with self.lock:
                self.bytes, self.sent_offset = self.bytes - length, 0
                self.lock.notify_all()  # room for a blocked append
        return sent

    def _settle(
        self, in_flight: list, permanent: Callable[[Exception], bool], on_set_aside: Callable[[], None]
    ) -> None:
        """Wait for every acknowledgement of a batch; a record refused for good goes aside --
        when it was alone in flight: a producer fails every record in flight with the one
        record's refusal (kafka-python aborts them all), so which one is at fault is then
        not known (BatchRefused: drain again with batch=1)."""
        for future, record in in_flight:
            try:
                future.get()
            except Exception as exc:  # noqa: BLE001 - the broker's refusal: aside, or stop the drain
                if len(in_flight) > 1 and permanent(exc):
                    raise BatchRefused(
                        f"{len(in_flight)} records in flight refused with {type(exc).__name__}: {exc}"
                    ) from exc
                self._refused(record, exc, permanent)
                on_set_aside()
        in_flight.clear()

    def _refused(
        self, record: tuple[str, bytes | None, bytes], exc: Exception, permanent: Callable[[Exception], bool]
    ) -> None:
        if not permanent(exc):
            raise exc
        topic, key, value = record
        line = json.dumps(
            {
                "topic": topic,
                "key": key.decode() if key is not None else None,
                "bytes": len(value),
                "error": f"{type(exc).__name__}: {exc}",
                "at": time.time(),
                "value": value.decode(),
            }
        )
        with open(self.dir / "set-aside.jsonl", "a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.set_aside += 1
        log.error(
            "a record the broker refuses for good was set aside; the records behind it go on",
            extra={
                "topic": topic,
                "key": key.decode(errors="replace") if key else None,
                "bytes": len(value),
                "file": str(self.dir / "set-aside.jsonl"),
                "error": f"{type(exc).__name__}: {exc}",
            },
        )

    # -- internals ---------------------------------------------------------------------------

    def _records(self, segment: int, start: int):
        with open(self._path(segment), "rb") as f:
            f.seek(start)
            while True:
                head = f.read(_HEAD.size)
                if not head:
                    return
                if len(head) < _HEAD.size:
                    log.warning("spool segment ends in a torn record: dropped", extra={"segment": segment})
                    return
                length, crc = _HEAD.unpack(head)
                payload = f.read(length)
                if len(payload) < length or zlib.crc32(payload) != crc:
                    log.warning("spool segment ends in a torn record: dropped", extra={"segment": segment})
                    return
                record = json.loads(payload)
                key = record["key"].encode() if record["key"] is not None else None
                yield f.tell(), (record["topic"], key, record["value"].encode())

    def _commit_loop(self) -> None:
        while not self.closed:
            time.sleep(self.commit_s)
            with self.lock:  # (the fsync on a file of its own: appends go on meanwhile)
                fd = os.dup(self.file.fileno()) if self.dirty and not self.closed else None
                self.dirty = False
            if fd is not None:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def _flush(self) -> None:
        if self.dirty and not self.closed:
            os.fsync(self.file.fileno())
            self.dirty = False

    def _roll(self) -> None:
        _fsync_and_close(self._swap())
        _fsync_dir(self.dir)

    def _swap(self):
        """A new open segment; returns the last one's file, still to be fsynced and closed."""
        full = self.file
        self.segment += 1
        self.file = open(self._path(self.segment), "ab")
        self.dirty = False
        return full

    def _segments(self) -> list[int]:
        return sorted(int(p.stem) for p in self.dir.glob("*.spool"))

    def _path(self, segment: int) -> Path:
        return self.dir / f"{segment:012d}.spool"

    def _length(self, segment: int) -> int:
        path = self._path(segment)
        return path.stat().st_size if path.exists() else 0

    def _position(self) -> tuple[int, int]:
        try:
            seg, off = (self.dir / "position").read_text().split()
            return int(seg), int(off)
        except (FileNotFoundError, ValueError):
            return 0, 0

    def _save_position(self, segment: int, offset: int) -> None:
        tmp = self.dir / "position.tmp"
        with open(tmp, "w") as f:
            f.write(f"{segment} {offset}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / "position")

    def close(self) -> None:
        with self.lock:
            self._flush()
            self.closed = True
            self.file.close()
            self.lockfile.close()  # releases the lock


def _fsync_and_close(file) -> None:
    try:
        os.fsync(file.fileno())
    finally:
        file.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
