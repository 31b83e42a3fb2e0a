"""Reward computation for 100k and 1M synthetic episodes with ~3 feedback events each.

The store (SQLite, or PostgreSQL with --postgres) is filled directly (not through Kafka: this
measures the reward stage), then `run_rewards` runs in a child process under the default
(rule-only) spec, once per number of workers (the stored rewards are deleted before each), then
once more with nothing new (what the daemon's incremental run costs). Prints episodes/s, the
time ratio 1M / 100k (linear would be 10) and peak RSS (of the parent of the workers, and of
the largest worker).

    .venv/bin/python benchmarks/reward.py                 # SQLite, 1 and 2 workers, 3 runs each
    .venv/bin/python benchmarks/reward.py --sizes 100000 --workers 2 --repeat 1  # a quick run
    .venv/bin/python benchmarks/reward.py --prompt-chars 3000   # production-sized prompts
    .venv/bin/python benchmarks/reward.py --postgres "$(bash scripts/postgres.sh)"  # on PostgreSQL

This machine's speed varies by tens of percent from minute to minute (shared cores): each
configuration runs `--repeat` times, interleaved, and the median is reported with the range.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.core.store import db as store_db  # noqa: E402
from pipeline.core.store import tables
from pipeline.core.store.events import Rows, output_columns, write_rows  # noqa: E402
from reward.spec import load_spec  # noqa: E402
from reward.stage import run_rewards  # noqa: E402
from tests.support.scratch_db import scratch_database  # noqa: E402

T0 = datetime(2026, 11, 1)
COMPLETIONS = [
    "def add(a, b):\n    return a + b",
    "SELECT name FROM users WHERE id = ?",
    "",  # abstentions exist in production
    "Could you clarify what you mean?",
    "for i in range(10):\n    print(i)",
]
OUTCOMES = [
    [("accepted", True), ("persisted", True), ("thumbs", True)],
    [("accepted", True), ("persisted", False), ("followup", True)],
    [("rejected", True), ("followup", True), ("thumbs", False)],
    [("edited", 0.8), ("persisted", True), ("test_result", 1.0)],
    [("tool_error", True), ("rejected", True), ("test_result", 0.0)],
]


def chat_prompt(chars: int, rng: random.Random) -> list[dict] | str:
    """ "p", or a system and a user message of about `chars` characters together (production
    prompts carry context: files, history)."""
    if chars <= 0:
        return "p"
    words = ["def", "return", "class", "import", "value", "index", "result", "self", "list", "for"]
    text = " ".join(rng.choice(words) for _ in range(chars // 6))
    return [{"role": "system", "content": text[: chars // 2]}, {"role": "user", "content": text[chars // 2 :]}]


def fill(url: str, n: int, seed: int = 0, prompt_chars: int = 0) -> None:
    """n interactions, 3 feedback events each, written in chunks as ingest would."""
    rng = random.Random(seed)
    prompts = [chat_prompt(prompt_chars, rng) for _ in range(16)]
    engine = store_db.make_engine(url)
    chunk = 20_000
    for start in range(0, n, chunk):
        rows = Rows()
        for i in range(start, min(start + chunk, n)):
            ts = T0 + timedelta(seconds=i)
            rid = f"r{i}"
            body = {
                "schema_version": 1,
                "event_id": f"i{i}",
                "type": "interaction",
                "ts": ts.isoformat() + "Z",
                "request_id": rid,
                "session_id": "s",
                "user_id": "u",
                "tenant": "t",
                "policy_version": str(1 + i % 3),
                "prompt": prompts[i % 16],
                "completion": rng.choice(COMPLETIONS),
            }
            rows.interaction.append(
                {
                    "event_id": f"i{i}",
                    "request_id": rid,
                    "schema_version": 1,
                    "ts": ts,
                    "session_id": "s",
                    "user_id": "u",
                    "tenant": "t",
                    "policy_version": body["policy_version"],
                    "body": json.dumps(body),
                    **output_columns(body["completion"], body.get("metadata")),  # as ingest
                    "source": "bench",
                    "partition": 0,
                    "offset": i,
                }
            )
            for j, (kind, value) in enumerate(rng.choice(OUTCOMES)):
                fb = {
                    "schema_version": 1,
                    "event_id": f"f{i}-{j}",
                    "type": "feedback",
                    "request_id": rid,
                    "ts": (ts + timedelta(seconds=60 * (j + 1))).isoformat() + "Z",
                    "kind": kind,
                    "value": value,
                }
                if kind == "edited":
                    fb["payload"] = {"text": "def add(a, b):\n    return b + a"}
                rows.feedback.append(
                    {
                        "event_id": fb["event_id"],
                        "request_id": rid,
                        "schema_version": 1,
                        "ts": ts + timedelta(seconds=60 * (j + 1)),
                        "kind": kind,
                        "value": float(value),
                        "body": json.dumps(fb),
                        "source": "bench",
                        "partition": 0,
                        "offset": n + 3 * i + j,
                    }
                )
        write_rows(engine, rows)
    engine.dispose()


def phase(url: str, workers: int, q) -> None:
    engine = store_db.make_engine(url)
    with engine.begin() as conn:
        for table in (tables.rewards, tables.reward_progress, tables.reward_waiting):  # a first run again
            conn.execute(table.delete())
    if engine.dialect.name == "postgresql":  # a live store's autovacuum would have caught up
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE rewards")
    spec = load_spec()
    t = time.perf_counter()
    report = run_rewards(engine, spec, now=T0 + timedelta(days=365), workers=workers)
    elapsed = time.perf_counter() - t
    rss = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    t = time.perf_counter()  # the daemon's case: an incremental run with nothing new
    again = run_rewards(engine, spec, now=T0 + timedelta(days=365), workers=workers)
    assert again.unchanged == report.computed, again.summary()
    q.put((report.computed, elapsed, rss / 1024, time.perf_counter() - t))


def run_phase(url: str, workers: int) -> tuple[int, float, float, float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=phase, args=(url, workers, q))
    proc.start()
    out = q.get()
    proc.join()
    return out


def new_store(tmp: Path, n: int, postgres: str | None) -> tuple[str, Callable[[], None]]:
    """(url, drop) of an empty store for n episodes: a SQLite file under tmp, or a database
    created through the PostgreSQL admin URL."""
    if postgres is None:
        return f"sqlite:///{tmp / f'r{n}.db'}", lambda: None
    return scratch_database(postgres, f"rtrl_reward_bench_{n}_{os.getpid()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3, help="runs per configuration (median reported)")
    ap.add_argument(
        "--prompt-chars",
        type=int,
        default=0,
        help="size of each interaction's prompt (default: a one-character prompt)",
    )
    ap.add_argument(
        "--postgres",
        metavar="ADMIN_URL",
        help="run on PostgreSQL: a database per size is created through this URL and dropped after",
    )
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rtrl-reward-bench-"))
    times = {}
    drops: list[Callable[[], None]] = []
    try:
        for n in args.sizes:
            url, drop = new_store(tmp, n, args.postgres)
            drops.append(drop)
            store_db.upgrade(url)
            t = time.perf_counter()
            fill(url, n, prompt_chars=args.prompt_chars)
            if args.postgres:  # planner statistics, as a live store's autovacuum keeps them
                engine = store_db.make_engine(url)
                with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                    conn.exec_driver_sql("ANALYZE")
                engine.dispose()
            print(f"filled {n:,} episodes + {3 * n:,} feedback in {time.perf_counter() - t:.0f}s")
            runs: dict[int, list[float]] = {w: [] for w in args.workers}
            for _ in range(args.repeat):  # interleaved: a slow minute hits every configuration alike
                for workers in args.workers:
                    computed, elapsed, rss, noop = run_phase(url, workers)
                    assert computed == n, f"computed {computed} of {n}"
                    runs[workers].append(elapsed)
                    print(
                        f"{n:>9,} episodes, {workers} worker(s): {elapsed:7.1f}s  {n / elapsed:9,.0f} episodes/s  "
                        f"peak RSS {rss:.0f} MB; then a run with nothing new {noop:.1f}s",
                        flush=True,
                    )
            for workers, elapsed in runs.items():
                times[n, workers] = med = statistics.median(elapsed)
                print(
                    f"{n:>9,} episodes, {workers} worker(s): median {med:.1f}s = {n / med:,.0f} episodes/s "
                    f"(runs {', '.join(f'{n / e:,.0f}' for e in elapsed)})",
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the stores: 2 GB at 1M
        for drop in drops:
            drop()
    for workers in args.workers:
        sizes = sorted(n for n, w in times if w == workers)
        if len(sizes) == 2:
            a, b = sizes
            print(
                f"{workers} worker(s): time {b:,} / time {a:,} = {times[b, workers] / times[a, workers]:.1f}  "
                f"(linear: {b / a:.0f}; target <= 11)"
            )


if __name__ == "__main__":
    main()
