"""Watermarks over the event tables that are safe under concurrent commits.

An incremental reader (the reward stage, the daemon's accept tally) remembers the largest ids it
read and next reads only larger ones. That is safe only if every id at or below the one it
remembers was committed (or never will be). Ids are handed out at insert, not at commit, so on
PostgreSQL a lane slow to commit can hold a smaller id than one already committed; a reader that
moved past that id would never see the row. `safe_tops` therefore reads the largest ids under a
SHARE lock, which waits for the transactions writing the table to end and holds new ones back
while the maximum is read (milliseconds). SQLite's writers take turns: its committed maximum is
safe as it is.
"""

from __future__ import annotations

import logging

from sqlalchemy import Connection, Engine, func, select
from sqlalchemy.exc import DBAPIError

from pipeline.core.store.tables import feedback, interactions

log = logging.getLogger("rtrl.store")

LOCK_TIMEOUT_S = 5.0  # how long safe_tops waits for a writer's transaction before giving up


def safe_tops(engine: Engine) -> tuple[int, int] | None:
    """(the largest interaction id, the largest feedback id; 0 for an empty table), each with
    every smaller id committed or never to be (see the module docstring). None on PostgreSQL when
    the lock is not to be had: the role may not take it (it needs UPDATE, DELETE or TRUNCATE on
    the tables), or a writer held its transaction open past LOCK_TIMEOUT_S: the caller then
    reads the whole history, as it would without a watermark."""
    tops = []
    for table in (interactions, feedback):
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql" and not _locked(conn, table.name):
                return None
            tops.append(conn.scalar(select(func.max(table.c.id))) or 0)
    return tops[0], tops[1]


def _locked(conn: Connection, table: str) -> bool:
    """A SHARE lock on `table` for the rest of the transaction (which the caller keeps short)."""
    try:
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(LOCK_TIMEOUT_S * 1000)}ms'")
        conn.exec_driver_sql(f"LOCK TABLE {table} IN SHARE MODE")
    except DBAPIError as exc:  # InsufficientPrivilege, LockNotAvailable
        log.warning(
            "no incremental read: the lock on %s was refused or timed out (%s); this read covers the whole history",
            table,
            type(exc.orig).__name__,
            extra={"table": table},
        )
        return False
    return True
