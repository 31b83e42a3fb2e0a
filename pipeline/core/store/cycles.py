"""Queries of the cycle state machine (pipeline/cycle.py): one row per cycle, updated as it
moves; the unfinished one is found and resumed after a crash."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Engine, select, update

from pipeline.core.store.deploys import decision_for_run
from pipeline.core.store.events import utcnow
from pipeline.core.store.leases import Fence, LeaseLost
from pipeline.core.store.tables import cycles
from pipeline.core.store.training import RunRecord


class CycleState(str, enum.Enum):
    """A cycle's states, stored as their value (pipeline/cycle.py draws the machine)."""

    PENDING = "pending"
    REWARDING = "rewarding"
    TRAINING = "training"
    EVALUATING = "evaluating"
    STAGING = "staging"
    CANARY = "canary"
    PROMOTING = "promoting"
    DONE = "done"
    SKIPPED = "skipped"
    REJECTED = "rejected"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


TERMINAL = (CycleState.DONE, CycleState.REJECTED, CycleState.SKIPPED, CycleState.FAILED)


@dataclass(frozen=True)
class CycleRecord:
    """A cycle as the store keeps it (one row of `cycles`, rewritten as the cycle moves): what the
    cycle, the daemon, the CLI and the demo read back."""

    cycle_id: str
    state: str  # a CycleState's value
    reason: str | None  # why it was skipped, rejected or failed
    run_id: str | None  # its training run, once it has one
    candidate_version: str | None  # the registered candidate, once staged
    promoted: int | None  # 0 / 1 once decided
    timings: dict[str, float]  # stage -> seconds
    owner: str | None  # the daemon (lease holder) that ran it
    started_at: datetime
    updated_at: datetime
    finished_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> CycleRecord:
        return cls(
            row.cycle_id,
            row.state,
            row.reason,
            row.run_id,
            row.candidate_version,
            row.promoted,
            row.timings or {},
            row.owner,
            row.started_at,
            row.updated_at,
            row.finished_at,
        )


def create_cycle(engine: Engine, cycle_id: str, owner: str | None = None, fence: Fence | None = None) -> None:
    now = utcnow()
    with engine.begin() as conn:
        if fence is not None:
            fence.check(conn)
        conn.execute(
            cycles.insert().values(
                cycle_id=cycle_id,
                state=CycleState.PENDING.value,
                timings={},
                owner=owner,
                started_at=now,
                updated_at=now,
            )
        )


def get_cycle(engine: Engine, cycle_id: str) -> CycleRecord | None:
    with engine.connect() as conn:
        row = conn.execute(select(cycles).where(cycles.c.cycle_id == cycle_id)).first()
    return CycleRecord.from_row(row) if row is not None else None


def set_cycle(engine: Engine, cycle_id: str, fence: Fence | None = None, **values: Any) -> None:
    """Update the cycle's row; with `fence`, only while the lease is still the fence's (else
    LeaseLost, nothing written): the check is part of the update's own statement."""
    now = utcnow()
    if "state" in values:
        values["state"] = CycleState(values["state"]).value
        if values["state"] in TERMINAL:
            values["finished_at"] = now
    where = [cycles.c.cycle_id == cycle_id]
    with engine.begin() as conn:
        if fence is not None:
            where.append(fence.held(conn.dialect.name))
        done = conn.execute(update(cycles).where(*where).values(updated_at=now, **values))
        if fence is not None and done.rowcount == 0:
            raise LeaseLost(fence.lost())


def unfinished_cycle(engine: Engine) -> CycleRecord | None:
    with engine.connect() as conn:
        row = conn.execute(
            select(cycles)
            .where(cycles.c.state.not_in([s.value for s in TERMINAL]))
            .order_by(cycles.c.started_at.desc())
            .limit(1)
        ).first()
    return CycleRecord.from_row(row) if row is not None else None


def recent_cycles(engine: Engine, limit: int = 20) -> list[CycleRecord]:
    """The newest cycles first."""
    with engine.connect() as conn:
        rows = conn.execute(select(cycles).order_by(cycles.c.started_at.desc()).limit(limit)).all()
    return [CycleRecord.from_row(r) for r in rows]


def cycle_split(engine: Engine, row: CycleRecord, run: RunRecord | None) -> dict[str, float]:
    """A finished cycle's seconds by part: its stages, with its training run's split
    (`train.load`, `train.loop` -- the training loop --, ...) and the gate's (`evaluate.generate`,
    ...); `<stage>.other` is what the stage spent around its parts. `run`: the cycle's training
    run row (None if it has none)."""
    decision = decision_for_run(engine, row.run_id) if row.run_id else None
    inner = {
        "train": (run.summary or {}).get("split_s", {}) if run is not None else {},
        "evaluate": decision.report.get("seconds", {}) if decision is not None else {},
    }
    out: dict[str, float] = {}
    for stage, seconds in (row.timings or {}).items():
        parts = inner.get(stage, {})
        for part, s in parts.items():
            out[f"{stage}.{part}"] = s
        out[f"{stage}.other" if parts else stage] = round(max(seconds - sum(parts.values()), 0.0), 4)
    return out
