"""Bulk inserts that skip what is already stored: the store's idempotent write path.

    insert_ignore(conn, table, rows, key, same)       INSERT .. ON CONFLICT (key) DO NOTHING, by
                                                      the driver's executemany of one statement
                                                      compiled once per table and dialect
    copy_insert_ignore(conn, table, rows, key, same)  the same on PostgreSQL: one binary COPY into
                                                      a temporary staging table, then one
                                                      INSERT .. SELECT with the same conflict rule

Both return how many rows were new. A batch re-delivered after a crash, or a replay of history,
adds nothing that is already there; a value the store refuses raises SQLAlchemy's DataError /
IntegrityError, which events.write_rows turns into dead letters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Table
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError


@dataclass(frozen=True)
class _InsertPlan:
    sql: str
    columns: tuple[str, ...]
    processors: tuple[Any, ...]  # per column: the dialect's bind processor, or None
    positional: bool


_PLANS: dict[tuple[str, str], _InsertPlan] = {}


def _insert_plan(conn: Connection, table: Table, key: list[str]) -> _InsertPlan:
    """`INSERT .. ON CONFLICT (key) DO NOTHING`, compiled once per table and dialect."""
    cache_key = (table.name, conn.dialect.name)
    if cache_key not in _PLANS:
        dialect_mod = sqlite if conn.dialect.name == "sqlite" else postgresql
        cols = [c for c in table.columns if not (c.primary_key and c.autoincrement is True)]
        compiled = (
            dialect_mod.insert(table)
            .on_conflict_do_nothing(index_elements=key)
            .compile(dialect=conn.dialect, column_keys=[c.key for c in cols])
        )
        names = tuple(compiled.positiontup) if compiled.positional else tuple(c.key for c in cols)
        by_name = {c.key: c for c in cols}
        _PLANS[cache_key] = _InsertPlan(
            sql=str(compiled),
            columns=names,
            processors=tuple(by_name[n].type.dialect_impl(conn.dialect).bind_processor(conn.dialect) for n in names),
            positional=compiled.positional,
        )
    return _PLANS[cache_key]


def insert_ignore(
    conn: Connection,
    table: Table,
    rows: Sequence[dict[str, Any]],
    key: list[str],
    same: dict[str, Any] | None = None,
) -> int:
    """Insert many rows, skipping those whose `key` exists; returns how many were new.
    `same` holds column values shared by every row (e.g. the batch's timestamp); a column a
    row leaves out is NULL (the store refuses it, naming the column, where NULL is not allowed).

    The hot path of ingest: one statement compiled once, executed by the driver's
    executemany (sqlite3's C loop, psycopg's pipeline), without SQLAlchemy's per-row
    parameter processing. Both drivers sum rowcount over the rows actually inserted.
    """
    if not rows:
        return 0
    plan = _insert_plan(conn, table, key)
    columns = list(zip(plan.columns, plan.processors))
    same = same or {}
    shared = {n: (same[n] if p is None else p(same[n])) for n, p in columns if n in same}
    params: list[Any] = []
    for row in rows:
        values = [shared[n] if n in shared else (row.get(n) if p is None else p(row.get(n))) for n, p in columns]
        params.append(tuple(values) if plan.positional else dict(zip(plan.columns, values)))
    return conn.exec_driver_sql(plan.sql, params).rowcount


@dataclass(frozen=True)
class _CopyPlan:
    stage: str  # the session's staging table: created when missing, emptied at every commit
    copy: str
    insert: str
    columns: tuple[str, ...]
    types: list[int]  # the staging table's column type oids, for binary COPY


_COPY_PLANS: dict[str, _CopyPlan] = {}


def _stage(cur: Any, table: Table) -> _CopyPlan:
    """The staging table of `table` in this session, and how to fill and drain it."""
    cols = tuple(c.key for c in table.columns if not (c.primary_key and c.autoincrement is True))
    stage, names = f"rtrl_stage_{table.name}", ", ".join(f'"{c}"' for c in cols)
    # IF NOT EXISTS every time: a rolled-back transaction takes the session's table with it
    # `_ord`: the batch's order, so that ids are handed out in log order, as executemany does
    cur.execute(
        f"CREATE TEMPORARY TABLE IF NOT EXISTS {stage} ON COMMIT DELETE ROWS AS "
        f"SELECT {names}, 0::bigint AS _ord FROM {table.name} WITH NO DATA"
    )
    if table.name not in _COPY_PLANS:
        cur.execute(f"SELECT {names}, _ord FROM {stage} LIMIT 0")
        _COPY_PLANS[table.name] = _CopyPlan(
            stage=stage,
            copy=f"COPY {stage} ({names}, _ord) FROM STDIN (FORMAT BINARY)",
            insert=f"INSERT INTO {table.name} ({names}) SELECT {names} FROM {stage} ORDER BY _ord",
            columns=cols,
            types=[d.type_code for d in cur.description],
        )
    return _COPY_PLANS[table.name]


_MAY_STAGE: dict[str, bool] = {}  # database URL -> whether this role may create temporary tables


def may_stage(conn: Connection) -> bool:
    """Whether the COPY path's staging table may be created: a role without the TEMPORARY
    privilege on its database (a hardened server) writes by executemany instead of failing
    every batch. Asked once per process and database."""
    key = conn.engine.url.render_as_string()
    if key not in _MAY_STAGE:
        _MAY_STAGE[key] = bool(
            conn.exec_driver_sql("SELECT has_database_privilege(current_database(), 'TEMPORARY')").scalar()
        )
    return _MAY_STAGE[key]


def copy_insert_ignore(
    conn: Connection,
    table: Table,
    rows: Sequence[dict[str, Any]],
    key: list[str],
    same: dict[str, Any] | None = None,
) -> int:
    """`insert_ignore` on PostgreSQL for ingest's batches: the rows COPYed (binary) into a
    temporary staging table, then inserted from it in one statement with the same conflict
    handling -- the data in one stream instead of a statement per row. A value the store
    refuses raises SQLAlchemy's DataError / IntegrityError, as the executemany path does."""
    if not rows:
        return 0
    import psycopg  # the PostgreSQL driver: only imported where PostgreSQL is used

    shared = same or {}
    try:
        driver = conn.connection.driver_connection
        assert driver is not None  # an open Connection holds its DBAPI connection
        with driver.cursor() as cur:
            plan = _stage(cur, table)
            cur.execute(f"DELETE FROM {plan.stage}")  # empty unless a batch earlier in this transaction used it
            with cur.copy(plan.copy) as copy:
                copy.set_types(plan.types)
                for order, row in enumerate(rows):
                    copy.write_row([shared[n] if n in shared else row.get(n) for n in plan.columns] + [order])
            cur.execute(f"{plan.insert} ON CONFLICT ({', '.join(key)}) DO NOTHING")
            return cur.rowcount
    except psycopg.Error as exc:
        raise DBAPIError.instance(f"COPY into {table.name}", None, exc, psycopg.Error) from exc
