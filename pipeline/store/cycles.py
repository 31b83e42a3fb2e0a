"""Queries of the cycle state machine (pipeline/cycle.py): one row per cycle, updated as it
moves; the unfinished one is found and resumed after a crash."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, select, update

from pipeline.store.events import utcnow
from pipeline.store.tables import cycles, gate_decisions

TERMINAL = ("done", "rejected", "skipped", "failed")


def create_cycle(engine: Engine, cycle_id: str, owner: str | None = None) -> None:
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(cycles.insert().values(cycle_id=cycle_id, state="pending", timings={}, owner=owner,
                                            started_at=now, updated_at=now))


def get_cycle(engine: Engine, cycle_id: str) -> Any | None:
    with engine.connect() as conn:
        return conn.execute(select(cycles).where(cycles.c.cycle_id == cycle_id)).first()


def set_cycle(engine: Engine, cycle_id: str, **values: Any) -> None:
    now = utcnow()
    if values.get("state") in TERMINAL:
        values["finished_at"] = now
    with engine.begin() as conn:
        conn.execute(update(cycles).where(cycles.c.cycle_id == cycle_id).values(updated_at=now, **values))


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
