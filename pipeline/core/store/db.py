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
from sqlalchemy.exc import ArgumentError, NoSuchModuleError


class SchemaError(RuntimeError):
    """The database schema is missing or behind the code."""


class StoreAccessError(RuntimeError):
    """The store cannot be opened or reached; the message names store.url and what to check."""


# words in a DBAPI's message -> what the operator checks; the first entry whose words all appear
_DIAGNOSES = (
    (("password authentication failed",), "the user or password in store.url is wrong"),
    (("no password supplied",), "the server wants a password: set RTRL_DB_PASSWORD or store.password_file"),
    (("database", "does not exist"), "create the database (`createdb NAME`, then `rtrl db upgrade`) or fix store.url"),
    (("role", "does not exist"), "the user in store.url does not exist on that server"),
    (("connection refused",), "no server answers there: is PostgreSQL up, and are the host and port right?"),
    (("could not translate host name",), "the host in store.url does not resolve"),
    (("name or service not known",), "the host in store.url does not resolve"),
    (("timeout",), "the server did not answer in time: is it up, and reachable from here?"),
    (("unable to open database file",), "the SQLite file's folder must exist and be writable"),
    (("permission denied",), "the store's user lacks a privilege rtrl needs (it owns its tables)"),
)


def shown_url(url: str | URL) -> str:
    """A store URL fit to print: its password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return "<unparseable URL>"


def store_failure(url: str | URL, exc: BaseException) -> StoreAccessError:
    """One line for a store that could not be reached or opened (the DBAPI's first line, and
    what to check), in place of SQLAlchemy's traceback."""
    text = str(getattr(exc, "orig", None) or exc).strip()
    detail = text.splitlines()[0] if text else type(exc).__name__
    hint = next(
        (h for words, h in _DIAGNOSES if all(w in detail.lower() for w in words)),
        "check store.url and that the database is up",
    )
    return StoreAccessError(f"store {shown_url(url)}: {detail}; {hint}")


# orjson for the JSON columns: several per event row, ~10x faster than the json module.
_JSON = {"json_serializer": lambda obj: orjson.dumps(obj).decode(), "json_deserializer": orjson.loads}


def in_memory(url: URL) -> bool:
    """An in-memory SQLite store: one database per connection, so per thread and per process."""
    return url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:")


def make_engine(url: str) -> Engine:
    """Create an engine; for SQLite, create the folder and set the pragmas on every connection.
    A URL SQLAlchemy cannot use, or a folder that cannot be made, is a StoreAccessError."""
    try:
        parsed = make_url(url)
        parsed.get_dialect()  # a scheme without a dialect (postgres://) fails here, not at first use
    except (ArgumentError, NoSuchModuleError) as exc:
        raise StoreAccessError(
            f"store.url {shown_url(url) if isinstance(exc, NoSuchModuleError) else repr(url)} cannot be used "
            f"({exc}): write postgresql+psycopg://USER@HOST:PORT/DB or sqlite:///PATH"
        ) from None
    if parsed.get_backend_name() == "sqlite":
        if not in_memory(parsed):
            folder = Path(parsed.database or "").expanduser().parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreAccessError(
                    f"store {shown_url(url)}: cannot create the folder {folder} ({exc.strerror}); fix store.url "
                    "or state_dir"
                ) from None
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
