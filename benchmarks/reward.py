"""Reward computation for 100k and 1M synthetic episodes with ~3 feedback events each.

The store is filled directly (not through Kafka: this measures the reward stage), then
`run_rewards` runs in a child process under the default (rule-only) spec. Prints episodes/s,
the time ratio 1M / 100k (linear would be 10) and peak RSS.

    .venv/bin/python benchmarks/reward.py                 # SQLite
    .venv/bin/python benchmarks/reward.py --sizes 100000  # a quick run
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.store import db as store_db  # noqa: E402
from pipeline.store.events import Rows, write_rows  # noqa: E402
from reward.spec import load_spec  # noqa: E402
from reward.stage import run_rewards  # noqa: E402

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


def fill(url: str, n: int, seed: int = 0) -> None:
    """n interactions, 3 feedback events each, written in chunks as ingest would."""
    rng = random.Random(seed)
    engine = store_db.make_engine(url)
    chunk = 20_000
    for start in range(0, n, chunk):
        rows = Rows()
        for i in range(start, min(start + chunk, n)):
            ts = T0 + timedelta(seconds=i)
            rid = f"r{i}"
            body = {"schema_version": 1, "event_id": f"i{i}", "type": "interaction", "ts": ts.isoformat() + "Z",
                    "request_id": rid, "session_id": "s", "user_id": "u", "tenant": "t",
                    "policy_version": str(1 + i % 3), "prompt": "p", "completion": rng.choice(COMPLETIONS)}
            rows.interaction.append({
                "event_id": f"i{i}", "request_id": rid, "schema_version": 1, "ts": ts, "session_id": "s",
                "user_id": "u", "tenant": "t", "policy_version": body["policy_version"], "body": json.dumps(body),
                "source": "bench", "partition": 0, "offset": i})
            for j, (kind, value) in enumerate(rng.choice(OUTCOMES)):
                fb = {"schema_version": 1, "event_id": f"f{i}-{j}", "type": "feedback", "request_id": rid,
                      "ts": (ts + timedelta(seconds=60 * (j + 1))).isoformat() + "Z", "kind": kind, "value": value}
                if kind == "edited":
                    fb["payload"] = {"text": "def add(a, b):\n    return b + a"}
                rows.feedback.append({
                    "event_id": fb["event_id"], "request_id": rid, "schema_version": 1,
                    "ts": ts + timedelta(seconds=60 * (j + 1)), "kind": kind, "value": float(value),
                    "body": json.dumps(fb), "source": "bench", "partition": 0, "offset": n + 3 * i + j})
        write_rows(engine, rows)
    engine.dispose()


def phase(url: str, q) -> None:
    engine = store_db.make_engine(url)
    spec = load_spec()
    t = time.perf_counter()
    report = run_rewards(engine, spec, now=T0 + timedelta(days=365))
    elapsed = time.perf_counter() - t
    q.put((report.computed, elapsed, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rtrl-reward-bench-"))
    times = {}
    for n in args.sizes:
        url = f"sqlite:///{tmp / f'r{n}.db'}"
        store_db.upgrade(url)
        t = time.perf_counter()
        fill(url, n)
        print(f"filled {n:,} episodes + {3 * n:,} feedback in {time.perf_counter() - t:.0f}s")
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=phase, args=(url, q))
        proc.start()
        computed, elapsed, rss = q.get()
        proc.join()
        assert computed == n, f"computed {computed} of {n}"
        times[n] = elapsed
        print(f"{n:>9,} episodes: {elapsed:7.1f}s  {n / elapsed:9,.0f} episodes/s  peak RSS {rss:.0f} MB")
    if len(times) == 2:
        (a, ta), (b, tb) = sorted(times.items())
        print(f"time {b:,} / time {a:,} = {tb / ta:.1f}  (linear: {b / a:.0f}; target <= 11)")


if __name__ == "__main__":
    main()
