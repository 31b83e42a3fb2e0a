"""One reward run split over worker processes (`rtrl reward run --workers N`).

Scoring is Python, one episode at a time, so one process uses one core. The interaction id
space is cut into fixed-width chunks (iter_episode_chunks); the run is cut into `4 x workers`
parts, part k taking every chunk whose index is k modulo the number of parts, so the parts
are evenly spread over old and new history. Each worker opens its own engine on the same
store, scores its parts and upserts their rewards itself; the store serialises the writes
(SQLite's WAL lets the other workers read meanwhile). Parts are disjoint, so no reward is
written twice, and each chunk commits on its own: a run that dies leaves whole chunks done and
the next run (incremental) does the rest.

Workers are spawned, not forked: the daemon runs threads (Kafka, the scheduler) that a fork
would copy mid-flight.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from datetime import datetime

from sqlalchemy import Engine

from pipeline.core.store import db as store_db
from pipeline.core.store.episode_reads import interaction_id_span
from reward.scoring import RewardRunReport, Settling, score_part
from reward.spec import RewardSpec

EPISODES_PER_WORKER = 25_000  # below this a worker's start (~0.7 s of imports) is not worth it
_ENGINES: dict[str, Engine] = {}  # per worker process: one engine for all its parts


def _score(
    url: str,
    spec: RewardSpec,
    now: datetime,
    force: bool,
    part: tuple[int, int],
    chunk: int,
    served_since: datetime | None,
    span: tuple[int, int] | None,
) -> tuple[RewardRunReport, Settling]:
    engine = _ENGINES.get(url)
    if engine is None:
        engine = _ENGINES[url] = store_db.make_engine(url)
    settling = Settling()
    report = score_part(
        engine,
        spec,
        now,
        force,
        RewardRunReport(spec_version=spec.version),
        part=part,
        chunk_size=chunk,
        served_since=served_since,
        span=span,
        settling=settling,
    )
    return report, settling


def auto_workers(engine: Engine, span: tuple[int, int] | None = None) -> int:
    """One worker per EPISODES_PER_WORKER interactions to read (the ids of `span`, else all the
    store holds), up to the CPUs (at most 4); 1 for an in-memory SQLite store, which other
    processes cannot open."""
    if store_db.in_memory(engine.url):
        return 1
    size = interaction_id_span(engine) if span is None else span[1] - span[0] + 1
    return max(1, min(os.cpu_count() or 1, 4, size // EPISODES_PER_WORKER))


def score_in_parallel(
    engine: Engine,
    spec: RewardSpec,
    now: datetime,
    force: bool,
    workers: int,
    report: RewardRunReport,
    on_progress: Callable[[RewardRunReport], None] | None = None,
    chunk: int = 5000,
    served_since: datetime | None = None,
    span: tuple[int, int] | None = None,
    settling: Settling | None = None,
) -> None:
    """Score every part (of the ids of `span`, else of the whole store) in a pool of `workers`
    processes, counting each into `report` and `settling`."""
    url = engine.url.render_as_string(hide_password=False)
    if store_db.in_memory(engine.url):
        raise ValueError("an in-memory SQLite store cannot be shared with worker processes; use workers=1")
    parts = 4 * workers
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            pool.submit(_score, url, spec, now, force, (k, parts), chunk, served_since, span) for k in range(parts)
        ]
        for future in as_completed(futures):
            counts, seen = future.result()
            report.add(counts)
            if settling is not None:
                settling.add(seen)
            if on_progress:
                on_progress(report)
