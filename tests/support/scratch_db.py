"""A scratch PostgreSQL database, for the test suite and the benchmarks."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url


def scratch_database(admin_url: str, name: str) -> tuple[str, Callable[[], None]]:
    """Create database `name` through `admin_url` (its role may CREATE DATABASE): its URL, and
    a function that drops it (closing whatever is still connected)."""
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return make_url(admin_url).set(database=name).render_as_string(hide_password=False), drop


@contextmanager
def restricted_role(url: str, grants: Sequence[str]) -> Iterator[Engine]:
    """An engine on the database at `url` logged in as a new role that has only `grants` (SQL
    with `{role}` and `{database}` to fill in); the role and what it owns are dropped after."""
    from pipeline.core.store import db as store_db

    role = f"rtrl_role_{uuid.uuid4().hex[:8]}"
    admin = store_db.make_engine(url)
    with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        database = conn.exec_driver_sql("SELECT quote_ident(current_database())").scalar()
        conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD 'x'")
        for sql in grants:
            conn.exec_driver_sql(sql.format(role=role, database=database))
    engine = store_db.make_engine(make_url(url).set(username=role, password="x").render_as_string(hide_password=False))
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")
        admin.dispose()
