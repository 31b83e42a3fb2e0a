"""A lease row: at most one daemon runs cycles against a store.

    acquire(name, owner, ttl)   take the lease if it is free, expired, or already ours (renewing
                                it); one conditional statement, atomic on SQLite and PostgreSQL
    release(name, owner)        give it up (expires now), if ours

A daemon that dies stops renewing; another takes the lease once `expires_at` has passed.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, and_, or_, select, update

from pipeline.store.events import insert_ignore, utcnow
from pipeline.store.tables import leases


def acquire(engine: Engine, name: str, owner: str, ttl_s: float) -> bool:
    now = utcnow()
    expires = now + timedelta(seconds=ttl_s)
    with engine.begin() as conn:
        if insert_ignore(conn, leases, [{"name": name, "owner": owner, "expires_at": expires, "heartbeat_at": now}],
                         ["name"]):
            return True
        taken = conn.execute(update(leases).where(and_(
            leases.c.name == name, or_(leases.c.owner == owner, leases.c.expires_at < now),
        )).values(owner=owner, expires_at=expires, heartbeat_at=now))
        return taken.rowcount == 1


def release(engine: Engine, name: str, owner: str) -> None:
    with engine.begin() as conn:
        conn.execute(update(leases).where(and_(leases.c.name == name, leases.c.owner == owner))
                     .values(expires_at=utcnow()))


def holder(engine: Engine, name: str) -> Any | None:
    with engine.connect() as conn:
        return conn.execute(select(leases).where(leases.c.name == name)).first()
