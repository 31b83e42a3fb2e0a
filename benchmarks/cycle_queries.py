"""What the daemon's per-cycle store queries cost as the history grows: each one timed on a store
of N episodes (3 feedback events each, benchmarks/reward.py's fill) after a full reward run, at
each size. A query whose time grows with N is one every cycle pays more for, forever. The
episodes' prompts are 16 tasks (the held-out slice is drawn by task; it is read here at 50 %
so that some task is held out: with none, the query reads every episode looking for one).

    reward run, nothing new       run_rewards (the cycle's first step; orphan count included)
    reward run, 10k new feedback  run_rewards after 10,000 late feedback events on episodes spread
                                  over the whole history (each repeat adds its own)
    orphan count, whole history   orphaned_feedback over the whole history (what a run that cannot
                                  be incremental counts: a judge's, a PostgreSQL role without the lock)
    selection, 1,000 new          train.selection.select: rewarded episodes past the last run's watermark
    held-out slice                select_eval_episodes: the gate's newest held-out episodes
    online check, last hour       online_units of two versions, the prompt covariate from 5,000 calls
                                  before (a staged rollout's sequential test)
    served and accepted           served_and_accepted of three versions (the demo's report, the audit)
    accept tally, 1k new          the daemon's metrics: AcceptTally.read after 1,000 new interactions
                                  and accepts (each repeat adds its own)

    .venv/bin/python benchmarks/cycle_queries.py --sizes 100000 1000000
    .venv/bin/python benchmarks/cycle_queries.py --postgres "$(bash scripts/postgres.sh)"
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import func, select  # noqa: E402

from benchmarks.reward import T0, fill, new_store  # noqa: E402
from pipeline.core.config import Config  # noqa: E402
from pipeline.core.store import db as store_db  # noqa: E402
from pipeline.core.store.accept_tally import AcceptTally  # noqa: E402
from pipeline.core.store.events import Rows, output_columns, write_rows  # noqa: E402
from pipeline.core.store.online import online_units, served_and_accepted  # noqa: E402
from pipeline.core.store.rewards import orphaned_feedback  # noqa: E402
from pipeline.core.store.tables import rewards  # noqa: E402
from pipeline.core.store.training import select_episodes, select_eval_episodes  # noqa: E402
from reward.spec import load_spec  # noqa: E402
from reward.stage import run_rewards  # noqa: E402


def best_ms(fn: Callable[[], object], repeat: int, prepared: bool = False) -> float:
    """The fastest of `repeat` calls of fn; `prepared`: fn prepares untimed and returns what to time."""
    best = float("inf")
    for _ in range(repeat):
        timed = fn() if prepared else fn
        start = time.perf_counter()
        timed()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def measure(url: str, n: int, repeat: int) -> dict[str, float]:
    engine = store_db.make_engine(url)
    spec, cfg = load_spec(), Config()
    now = T0 + timedelta(seconds=n + 3600)  # an hour after the last episode: every one ripe
    report = run_rewards(engine, spec, now=now)
    assert report.computed == n, report.summary()
    with engine.connect() as conn:
        newest = conn.scalar(select(func.max(rewards.c.id)))
    last_hour = T0 + timedelta(seconds=n - 3600)
    late = iter(range(repeat))

    def late_feedback() -> Callable[[], object]:
        """10,000 new feedback events on old episodes, stored untimed; the run is what is timed."""
        k = next(late)
        rng, rows = random.Random(k), Rows()
        for j, i in enumerate(rng.sample(range(n), min(10_000, n))):
            ts = T0 + timedelta(seconds=i + 600)
            body = {
                "schema_version": 1,
                "event_id": f"late{k}-{j}",
                "type": "feedback",
                "request_id": f"r{i}",
                "ts": ts.isoformat() + "Z",
                "kind": "thumbs",
                "value": True,
            }
            rows.feedback.append(
                {
                    "event_id": body["event_id"],
                    "request_id": f"r{i}",
                    "schema_version": 1,
                    "ts": ts,
                    "kind": "thumbs",
                    "value": 1.0,
                    "body": json.dumps(body),
                    "source": "late",
                    "partition": k,
                    "offset": j,
                }
            )
        write_rows(engine, rows)
        return lambda: run_rewards(engine, spec, now=now)

    tally = AcceptTally()
    tally.read(engine)  # the daemon's first read: the whole history, once per process
    newer = iter(range(repeat))

    def new_traffic() -> Callable[[], object]:
        """1,000 new interactions of version 2, half of them accepted, stored untimed."""
        k, rows = next(newer), Rows()
        for j in range(1000):
            i, ts = f"new{k}-{j}", T0 + timedelta(seconds=n + j)
            body = {
                "schema_version": 1,
                "event_id": f"i{i}",
                "type": "interaction",
                "ts": ts.isoformat() + "Z",
                "request_id": f"r{i}",
                "session_id": "s",
                "user_id": "u",
                "tenant": "t",
                "policy_version": "2",
                "prompt": "p",
                "completion": "x",
            }
            rows.interaction.append(
                {
                    "event_id": f"i{i}",
                    "request_id": f"r{i}",
                    "schema_version": 1,
                    "ts": ts,
                    "session_id": "s",
                    "user_id": "u",
                    "tenant": "t",
                    "policy_version": "2",
                    "body": json.dumps(body),
                    **output_columns("x", None),
                    "source": "new",
                    "partition": k,
                    "offset": j,
                }
            )
            if j % 2:
                rows.feedback.append(
                    {
                        "event_id": f"f{i}",
                        "request_id": f"r{i}",
                        "schema_version": 1,
                        "ts": ts,
                        "kind": "accepted",
                        "value": 1.0,
                        "body": "{}",
                        "source": "new",
                        "partition": k,
                        "offset": j,
                    }
                )
        write_rows(engine, rows)
        return lambda: tally.read(engine, ["1", "2", "3"])

    queries = {
        "reward run, nothing new": lambda: run_rewards(engine, spec, now=now),
        "reward run, 10k new": late_feedback,
        "orphan count, whole history": lambda: orphaned_feedback(
            engine, now - timedelta(seconds=spec.join.orphan_ttl_s)
        ),
        "selection, 1,000 new": lambda: select_episodes(
            engine, spec.version, since_reward_id=newest - 1000, holdout_percent=cfg.train.holdout_percent
        ),
        "held-out slice": lambda: select_eval_episodes(engine, spec.version, 50.0, cfg.gate.eval_episodes),
        "online check, last hour": lambda: online_units(
            engine, spec.version, ["1", "2"], last_hour, covariate="prompt", history=cfg.rollout.covariate_history
        ),
        "served and accepted": lambda: served_and_accepted(engine, ["1", "2", "3"]),
        "accept tally, 1k new": new_traffic,
    }
    prepared = ("reward run, 10k new", "accept tally, 1k new")
    out = {name: best_ms(fn, repeat, prepared=name in prepared) for name, fn in queries.items()}
    engine.dispose()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3, help="runs per query; the fastest counts")
    ap.add_argument("--postgres", metavar="ADMIN_URL", help="on PostgreSQL (a database per size, dropped after)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="rtrl-cycle-bench-"))
    results: dict[int, dict[str, float]] = {}
    try:
        for n in args.sizes:
            url, drop = new_store(tmp, n, args.postgres)
            try:
                store_db.upgrade(url)
                start = time.perf_counter()
                fill(url, n, prompt_chars=40)
                if args.postgres:  # planner statistics, as a live store's autovacuum keeps them
                    engine = store_db.make_engine(url)
                    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                        conn.exec_driver_sql("ANALYZE")
                    engine.dispose()
                print(f"filled {n:,} episodes in {time.perf_counter() - start:.0f}s", flush=True)
                results[n] = measure(url, n, args.repeat)
                for name, ms in results[n].items():
                    print(f"{n:>9,} episodes  {name:26} {ms:9.1f} ms", flush=True)
            finally:
                drop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if len(results) >= 2:
        small, large = min(results), max(results)
        print(f"\n{'query':26} {small:>11,} {large:>11,}  ratio (flat: 1; linear: {large // small})")
        for name in results[small]:
            a, b = results[small][name], results[large][name]
            print(f"{name:26} {a:9.1f}ms {b:9.1f}ms  {b / a:5.1f}")


if __name__ == "__main__":
    main()
