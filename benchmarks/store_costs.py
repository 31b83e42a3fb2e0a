"""What each secondary index costs ingest per stored event, on SQLite (WAL, synchronous=FULL).

Decodes N interactions (~2 KB, the ingest benchmark's) and N feedback events once, then writes
them with `write_rows` in batches of 2,000 -- as ingest does, one transaction each -- into a
fresh store with every index, and into fresh stores each missing one secondary index of the
table written. Prints microseconds per event and each index's share, and what the column
`output_text` (the completion's text, stored beside the body so that a reward run never parses
bodies) costs: the same interactions written with it empty. `--completion-chars` sizes the
completions (the default: a 12-word one).

    .venv/bin/python benchmarks/store_costs.py --events 40000
    .venv/bin/python benchmarks/store_costs.py --events 20000 --completion-chars 2000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import inspect, text  # noqa: E402

from ingest.batch import decode_records  # noqa: E402
from pipeline.core.store import db as store_db  # noqa: E402
from pipeline.core.store.events import Rows, write_rows  # noqa: E402
from tests.support.factories import encode, feedback, interaction  # noqa: E402

BATCH = 2000


def batches(kind: str, n: int, completion_chars: int = 0) -> list[Rows]:
    def make_interaction(i: int) -> dict:
        if not completion_chars:
            return interaction(i, prefix="s", size=2048)
        text = ("x = 1\n" * (completion_chars // 6 + 1))[:completion_chars]
        return interaction(i, prefix="s", size=2048 + completion_chars, completion=text)

    make = make_interaction if kind == "interaction" else (lambda i: feedback(i, prefix="s"))
    out = []
    for lo in range(0, n, BATCH):
        records = [("t", 0, i, encode(make(i))) for i in range(lo, min(lo + BATCH, n))]
        out.append(decode_records(records, 1 << 20).rows)
    return out


def _with_todays_columns(engine) -> None:
    """An older revision's store with the columns today's code writes added (no index): its
    indexes are what is measured, and ingest's rows carry every column of today's tables."""
    from pipeline.core.store.tables import feedback, interactions

    schema = inspect(engine)
    with engine.begin() as conn:
        for table in (interactions, feedback):
            have = {c["name"] for c in schema.get_columns(table.name)}
            for column in table.columns:
                if column.name not in have:
                    kind = column.type.compile(dialect=engine.dialect)
                    conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))


def write_us(workdir: Path, name: str, rows: list[Rows], drop: str | None, repeat: int, revision: str) -> float:
    best = float("inf")
    for r in range(repeat):
        url = f"sqlite:///{workdir / f'{name}-{r}.db'}"
        store_db.upgrade(url, revision)
        engine = store_db.make_engine(url)
        if drop:
            with engine.begin() as conn:
                conn.execute(text(f"DROP INDEX {drop}"))
        _with_todays_columns(engine)
        start = time.perf_counter()
        for batch in rows:
            write_rows(engine, batch)
        best = min(best, (time.perf_counter() - start) / sum(len(b) for b in rows) * 1e6)
        engine.dispose()
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=40_000, help="events of each kind")
    ap.add_argument("--repeat", type=int, default=2, help="runs per variant; the fastest counts")
    ap.add_argument("--revision", default="head", help="the schema to measure (e.g. 0011: before 0012 dropped two)")
    ap.add_argument("--completion-chars", type=int, default=0, help="each interaction's completion, in characters")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-store-") as tmp:
        workdir = Path(tmp)
        store_db.upgrade(f"sqlite:///{workdir / 'schema.db'}", args.revision)
        schema = inspect(store_db.make_engine(f"sqlite:///{workdir / 'schema.db'}"))
        for kind, table in (("interaction", "interactions"), ("feedback", "feedback")):
            rows = batches(kind, args.events, args.completion_chars)
            full = write_us(workdir, f"{table}-all", rows, None, args.repeat, args.revision)
            print(f"{table}: {full:.1f} us/event with every index of schema {args.revision}", flush=True)
            if kind == "interaction":
                texts = [row for batch in rows for row in batch.interaction]
                chars = sum(len(row["output_text"]) for row in texts) // len(texts)
                for row in texts:
                    row["output_text"] = ""
                empty = write_us(workdir, f"{table}-no-text", rows, None, args.repeat, args.revision)
                rows = batches(kind, args.events, args.completion_chars)
                print(
                    f"  without output_text ({chars} chars) {empty:6.1f} us/event  "
                    f"(the column: {full - empty:+.1f} us)",
                    flush=True,
                )
            for index in sorted(ix["name"] for ix in schema.get_indexes(table)):
                without = write_us(workdir, f"{table}-{index}", rows, index, args.repeat, args.revision)
                print(
                    f"  without {index:32} {without:6.1f} us/event  (the index: {full - without:+.1f} us)", flush=True
                )


if __name__ == "__main__":
    main()
