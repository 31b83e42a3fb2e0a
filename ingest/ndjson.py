"""NDJSON(.gz) files: the exchange format of `rtrl export` and `rtrl replay --file`.

One event per line, UTF-8 JSON, exactly the Kafka record value. A `.gz` name (or gzip magic
bytes) means gzip. `-` is stdin/stdout.
"""

from __future__ import annotations

import gzip
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from sqlalchemy import Engine

from pipeline.core.store.event_reads import iter_event_bodies

_GZIP_MAGIC = b"\x1f\x8b"


@contextmanager
def open_read(path: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdin.buffer
        return
    with open(path, "rb") as raw:
        magic = raw.peek(2)[:2]
        if magic == _GZIP_MAGIC or path.endswith(".gz"):
            with gzip.open(raw) as f:
                yield f
        else:
            yield raw


def iter_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes without the newline) for every line of the file."""
    with open_read(path) as f:
        for lineno, line in enumerate(f, start=1):
            yield lineno, line.rstrip(b"\r\n")


def source_name(path: str) -> str:
    """A stable name for dead letters from this file, whatever the working directory."""
    return "file:-" if path == "-" else f"file:{Path(path).resolve()}"


@contextmanager
def open_write(path: str) -> Iterator[IO[bytes]]:
    if path == "-":
        yield sys.stdout.buffer
        sys.stdout.buffer.flush()
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    if path.endswith(".gz"):
        # no name, mtime=0: the same events give byte-identical files
        with open(path, "wb") as raw, gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
            yield f
    else:
        with open(path, "wb") as f:
            yield f


def export_events(engine: Engine, path: str, on_progress=None) -> int:
    """Write every stored event to `path` as NDJSON(.gz); returns how many."""
    n = 0
    with open_write(path) as out:
        for body in iter_event_bodies(engine):
            out.write(body.encode("utf-8"))
            out.write(b"\n")
            n += 1
            if on_progress and n % 10_000 == 0:
                on_progress(n)
    return n
