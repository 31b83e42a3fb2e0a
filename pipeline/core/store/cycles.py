"""Queries of the cycle state machine (pipeline/cycle.py): one row per cycle, updated as it
moves; the unfinished one is found and resumed after a crash."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, select, update

from pipeline.core.store.events import utcnow
from pipeline.core.store.leases import Fence, LeaseLost
from pipeline.core.store.tables import cycles, gate_decisions

TERMINAL = ("done", "rejected", "skipped", "failed")


def create_cycle(engine: Engine, cycle_id: str, owner: str | None = None, fence: Fence | None = None) -> None:
    now = utcnow()
    with engine.begin() as conn:
        if fence is not None:
            fence.check(conn)
        conn.execute(cycles.insert().values(cycle_id=cycle_id, state="pending", timings={}, owner=owner,
                                            started_at=now, updated_at=now))


def get_cycle(engine: Engine, cycle_id: str) -> Any | None:
    with engine.connect() as conn:
        return conn.execute(select(cycles).where(cycles.c.cycle_id == cycle_id)).first()


def set_cycle(engine: Engine, cycle_id: str, fence: Fence | None = None, **values: Any) -> None:
    """Update the cycle's row; with `fence`, only while the lease is still the fence's (else
    LeaseLost, nothing written): the check is part of the update's own statement."""
    now = utcnow()
    if values.get("state") in TERMINAL:
        values["finished_at"] = now
    where = [cycles.c.cycle_id == cycle_id]
    with engine.begin() as conn:
        if fence is not None:
            where.append(fence.held(conn.dialect.name))
        done = conn.execute(update(cycles).where(*where).values(updated_at=now, **values))
        if fence is not None and done.rowcount == 0:
            raise LeaseLost(fence.lost())


def unfinished_cycle(engine: Engine) -> Any | None:
    with engine.connect() as conn:
        return conn.execute(select(cycles).where(cycles.c.state.not_in(TERMINAL))
                            .order_by(cycles.c.started_at.desc()).limit(1)).first()


def recent_cycles(engine: Engine, limit: int = 20) -> list[Any]:
    with engine.connect() as conn:
        return conn.execute(select(cycles).order_by(cycles.c.started_at.desc()).limit(limit)).all()


def decision_for_run(engine: Engine, run_id: str) -> Any | None:
    with engine.connect() as conn:
        return conn.execute(select(gate_decisions).where(gate_decisions.c.run_id == run_id)
                            .order_by(gate_decisions.c.id.desc()).limit(1)).first()
