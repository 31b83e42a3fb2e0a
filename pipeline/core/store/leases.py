"""A lease row: at most one daemon runs cycles against a store, and only it writes them.

    acquire(name, owner, ttl)   take the lease if it is free, expired, or already ours (renewing
                                it); one conditional statement, atomic on SQLite and PostgreSQL;
                                returns the lease's generation (None: another daemon holds it)
    release(name, owner)        give it up (expires now), if ours
    Fence(name, owner, gen)     the holder's fencing token: `held()` is a condition a write adds
                                to its own statement, so the write happens only while the lease
                                is still ours with the same generation; `check(conn)` raises
                                LeaseLost inside a caller's transaction otherwise

A daemon that dies stops renewing; another takes the lease once `expires_at` has passed and the
generation grows. A daemon that was only paused (a long GC, a frozen VM, a store outage longer
than the ttl) still believes it holds the lease: its heartbeats stopped, but its cycle runs on.
Every state write of a cycle and every registry move carries its Fence, so such a daemon's next
write finds the generation moved on and raises LeaseLost -- it stops, instead of gating and
promoting beside the new holder.

Times are the database's clock, never a host's: two daemons on hosts whose clocks disagree by
more than the ttl would otherwise both see the lease as theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, and_, case, exists, func, literal, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import Exists

from pipeline.core.store.tables import leases


class LeaseLost(RuntimeError):
    """This daemon's lease was taken over (or expired): its cycle stops; the holder resumes it."""


def db_now(dialect: str, plus_s: float = 0.0) -> ColumnElement[Any]:
    """The database's current UTC time (+ `plus_s`), as the store's naive-UTC DateTime columns
    hold it (SQLite: text with microseconds, so that it compares with what SQLAlchemy wrote)."""
    if dialect == "sqlite":
        args = ("%Y-%m-%d %H:%M:%f", "now") + ((f"{plus_s:+.6f} seconds",) if plus_s else ())
        return func.strftime(*args).concat(literal("000"))  # milliseconds -> microseconds
    now = func.timezone("UTC", func.clock_timestamp())
    return now + timedelta(seconds=plus_s) if plus_s else now


def acquire(engine: Engine, name: str, owner: str, ttl_s: float) -> int | None:
    dialect = engine.dialect.name
    now, expires = db_now(dialect), db_now(dialect, ttl_s)
    with engine.begin() as conn:
        # a new row: the first generation (an existing one is left to the update below)
        insert = (sqlite_insert if dialect == "sqlite" else pg_insert)(leases)
        inserted = conn.execute(
            insert.values(
                name=name, owner=owner, expires_at=expires, heartbeat_at=now, generation=1
            ).on_conflict_do_nothing(index_elements=["name"])
        )
        if inserted.rowcount == 1:
            return 1
        mine_and_live = and_(leases.c.owner == owner, leases.c.expires_at >= now)
        taken = conn.execute(
            update(leases)
            .where(
                and_(
                    leases.c.name == name,
                    or_(leases.c.owner == owner, leases.c.expires_at < now),
                )
            )
            .values(
                owner=owner,
                expires_at=expires,
                heartbeat_at=now,
                # renewing a live lease keeps the generation; taking it (or re-taking our own
                # after it expired, when a cycle of ours may still be running) moves it on
                generation=case((mine_and_live, leases.c.generation), else_=leases.c.generation + 1),
            )
            .returning(leases.c.generation)
        ).first()
        return None if taken is None else int(taken[0])


def release(engine: Engine, name: str, owner: str) -> None:
    with engine.begin() as conn:
        conn.execute(
            update(leases)
            .where(and_(leases.c.name == name, leases.c.owner == owner))
            .values(expires_at=db_now(engine.dialect.name))
        )


@dataclass(frozen=True)
class LeaseRecord:
    """Who holds (or last held) a lease, until when, under which fencing generation."""

    name: str
    owner: str
    expires_at: datetime  # the database's clock
    heartbeat_at: datetime
    generation: int  # grows whenever the lease changes hands or is re-taken after expiring


def holder(engine: Engine, name: str) -> LeaseRecord | None:
    with engine.connect() as conn:
        row = conn.execute(select(leases).where(leases.c.name == name)).first()
    return (
        LeaseRecord(row.name, row.owner, row.expires_at, row.heartbeat_at, row.generation) if row is not None else None
    )


@dataclass(frozen=True)
class Fence:
    """A lease holder's fencing token (the lease name, its owner and generation)."""

    name: str
    owner: str
    generation: int

    def held(self, dialect: str) -> Exists:
        """A condition for a write's WHERE: the lease is still ours, this generation, not expired."""
        return exists().where(
            and_(
                leases.c.name == self.name,
                leases.c.owner == self.owner,
                leases.c.generation == self.generation,
                leases.c.expires_at >= db_now(dialect),
            )
        )

    def check(self, conn: Connection) -> None:
        """Raise LeaseLost unless the lease is still ours (inside the caller's transaction)."""
        if not conn.execute(select(self.held(conn.dialect.name))).scalar():
            raise LeaseLost(self.lost())

    def lost(self) -> str:
        return (
            f"lease {self.name!r} generation {self.generation} is no longer held by {self.owner}: "
            "another daemon took it over (or it expired); this cycle stops, the holder resumes it"
        )
