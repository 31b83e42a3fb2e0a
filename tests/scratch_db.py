"""A scratch PostgreSQL database, for the test suite and the benchmarks."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import create_engine, text
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
