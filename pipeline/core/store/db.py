"""Engines and schema versions.

One engine per process. SQLite runs in WAL mode with `synchronous=FULL`, so a committed
batch survives a power cut, not only a crash: offsets are committed to Kafka only after it.
The schema is owned by alembic; `require_current_schema` refuses to run against a database
that is behind, naming the command that fixes it.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import orjson
from alembic import command
from alembic.config import Config as AlembicConfig
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url


class SchemaError(RuntimeError):
    """The database schema is missing or behind the code."""


# orjson for the JSON columns: several per event row, ~10x faster than the json module.
_JSON = {"json_serializer": lambda obj: orjson.dumps(obj).decode(), "json_deserializer": orjson.loads}


def in_memory(url: URL) -> bool:
    """An in-memory SQLite store: one database per connection, so per thread and per process."""
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def make_engine(url: str) -> Engine:
    """Create an engine; for SQLite, create the folder and set the pragmas on every connection."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        if not in_memory(parsed):
            Path(parsed.database or "").expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 60}, **_JSON)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):  # pragma: no cover - trivial
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, **_JSON)


@cache
def migrations_dir() -> Path:
    """The alembic scripts: `alembic/` in a source checkout, `rtrl_alembic/` beside `pipeline/`
    in site-packages when installed from a wheel (see pyproject.toml)."""
    root = Path(__file__).resolve().parents[3]
    for candidate in (root / "alembic", root / "rtrl_alembic"):
        if (candidate / "env.py").exists():
            return candidate
    raise SchemaError(f"alembic migrations not found under {root}: reinstall rtrl")


def alembic_config(url: str) -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(migrations_dir()))
    # '%' is alembic's interpolation character; URLs may contain it (escaped passwords).
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    if head is None:
        raise SchemaError(f"no alembic revision under {migrations_dir()}: reinstall rtrl")
    return head


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade(url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str) -> None:
    command.downgrade(alembic_config(url), revision)


def require_current_schema(engine: Engine) -> None:
    """Raise SchemaError unless the database is at the newest migration."""
    current, head = current_revision(engine), head_revision()
    if current != head:
        shown = engine.url.render_as_string(hide_password=True)
        state = "has no rtrl schema" if current is None else f"is at revision {current}"
        raise SchemaError(f"database {shown} {state}, the code needs {head}: run `rtrl db upgrade` first")
