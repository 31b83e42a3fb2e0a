"""Queries of the deploy stage: gate decisions and the audit trail of alias moves.

An alias move is written in three steps around the registry call:
    begin_move      a "pending" row (who, why, from, to) -- before the registry is touched
    complete_move   "done" once the registry moved, or "not_applied" if it did not
    mark_published  once the model-update event is on Kafka (or when a newer move of the same
                    alias superseded it before it could be sent: its event would be stale)
A crash leaves "pending" rows or unpublished "done" rows; the registry repairs them on start.
Each row's id is the move's sequence number: model-update events carry it as `seq`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import CursorResult, Engine, and_, func, select, update

from pipeline.core.store.events import utcnow
from pipeline.core.store.leases import Fence
from pipeline.core.store.tables import alias_moves, gate_decisions


def _inserted_id(result: CursorResult[Any]) -> int:
    """The id the store gave the row one INSERT added."""
    key = result.inserted_primary_key
    if key is None:  # only for an INSERT of several rows, which these are not
        raise RuntimeError("the store returned no id for the inserted row")
    return int(key[0])


def record_decision(
    engine: Engine,
    model_name: str,
    candidate_version: str,
    champion_version: str | None,
    run_id: str | None,
    passed: bool,
    report: dict[str, Any],
    fence: Fence | None = None,
) -> int:
    with engine.begin() as conn:
        if fence is not None:
            fence.check(conn)
        return _inserted_id(
            conn.execute(
                gate_decisions.insert().values(
                    model_name=model_name,
                    candidate_version=candidate_version,
                    champion_version=champion_version,
                    run_id=run_id,
                    passed=int(passed),
                    report=report,
                    decided_at=utcnow(),
                )
            )
        )


@dataclass(frozen=True)
class StoredDecision:
    """A decision as the store keeps it: the gate's (deploy/gate.py) or a canary's online one
    (deploy/rollout.py), with its report. The one type the cycle, the registry, the CLI and the
    demo read decisions as."""

    id: int
    model_name: str
    candidate_version: str
    champion_version: str | None
    run_id: str | None  # the candidate's training run (None for an online decision)
    passed: bool
    report: dict[str, Any]  # {"decision": {"passed", "first_deployment", "checks": [...]}, ...}
    decided_at: datetime

    @classmethod
    def from_row(cls, row: Any) -> StoredDecision:
        return cls(
            row.id,
            row.model_name,
            row.candidate_version,
            row.champion_version,
            row.run_id,
            bool(row.passed),
            row.report,
            row.decided_at,
        )

    @property
    def stage(self) -> str:
        """ "gate" (offline, before any traffic) or "online" (a canary's live comparison)."""
        return self.report.get("stage", "gate")

    @property
    def cycle(self) -> str | None:
        return self.report.get("cycle")

    @property
    def checks(self) -> list[dict[str, Any]]:
        return self.report["decision"]["checks"]

    @property
    def reasons(self) -> list[str]:
        """The failing checks' details (none when it passed)."""
        return [c["detail"] for c in self.checks if not c["passed"]]

    @property
    def summary(self) -> str:
        """Why, in a line: the failing checks, or every check's numbers on a pass."""
        return "; ".join(c["detail"] for c in self.checks if self.passed or not c["passed"])


def latest_decision(engine: Engine, model_name: str, version: str) -> StoredDecision | None:
    with engine.connect() as conn:
        row = conn.execute(
            select(gate_decisions)
            .where(
                and_(
                    gate_decisions.c.model_name == model_name,
                    gate_decisions.c.candidate_version == version,
                )
            )
            .order_by(gate_decisions.c.id.desc())
            .limit(1)
        ).first()
    return StoredDecision.from_row(row) if row is not None else None


def decision_for_run(engine: Engine, run_id: str) -> StoredDecision | None:
    """The latest gate decision on training run `run_id`'s candidate."""
    with engine.connect() as conn:
        row = conn.execute(
            select(gate_decisions)
            .where(gate_decisions.c.run_id == run_id)
            .order_by(gate_decisions.c.id.desc())
            .limit(1)
        ).first()
    return StoredDecision.from_row(row) if row is not None else None


@dataclass(frozen=True)
class MoveRecord:
    """One move of a registry alias as the audit table keeps it: written `pending` before the
    registry call and `done` after it, so a crash in between is found and repaired."""

    id: int
    model_name: str
    alias: str  # champion | canary | ...
    from_version: str | None
    to_version: str | None  # None: the alias was cleared (a canary withdrawn)
    reason: str
    actor: str  # "automatic" or a named operator
    at: datetime
    status: str  # pending | done | not_applied
    published_at: datetime | None  # when the model-update event went to Kafka
    share: float | None  # `canary` moves: the share of requests the canary serves
    kind: str | None  # promote | rollback | stage | withdraw (None: written before migration 0009)

    @classmethod
    def from_row(cls, row: Any) -> MoveRecord:
        return cls(
            row.id,
            row.model_name,
            row.alias,
            row.from_version,
            row.to_version,
            row.reason,
            row.actor,
            row.at,
            row.status,
            row.published_at,
            row.share,
            row.kind,
        )


def all_decisions(engine: Engine) -> list[StoredDecision]:
    """Every decision, oldest first."""
    with engine.connect() as conn:
        return [StoredDecision.from_row(r) for r in conn.execute(select(gate_decisions).order_by(gate_decisions.c.id))]


def begin_move(
    engine: Engine,
    model_name: str,
    alias: str,
    from_version: str | None,
    to_version: str | None,
    reason: str,
    actor: str,
    share: float | None = None,
    kind: str | None = None,
    fence: Fence | None = None,
) -> int:
    """`to_version` None clears the alias; `share`: a canary's share of requests; `kind`:
    promote | rollback | stage | withdraw; `fence`: a daemon's move is recorded (and then made)
    only while it holds the cycle lease."""
    with engine.begin() as conn:
        if fence is not None:
            fence.check(conn)
        return _inserted_id(
            conn.execute(
                alias_moves.insert().values(
                    model_name=model_name,
                    alias=alias,
                    from_version=from_version,
                    to_version=to_version,
                    reason=reason,
                    actor=actor,
                    at=utcnow(),
                    status="pending",
                    share=share,
                    kind=kind,
                )
            )
        )


def promoted_from(engine: Engine, model_name: str, version: str) -> str | None:
    """The champion `version` replaced when it was last promoted (not restored by a rollback):
    where a rollback from `version` goes. None if it never was promoted, or replaced nothing."""
    with engine.connect() as conn:
        return conn.execute(
            select(alias_moves.c.from_version)
            .where(
                and_(
                    alias_moves.c.model_name == model_name,
                    alias_moves.c.alias == "champion",
                    alias_moves.c.to_version == version,
                    alias_moves.c.status == "done",
                    (alias_moves.c.kind.is_(None)) | (alias_moves.c.kind != "rollback"),
                )
            )
            .order_by(alias_moves.c.id.desc())
            .limit(1)
        ).scalar()


def rolled_back(engine: Engine, model_name: str, version: str) -> MoveRecord | None:
    """The rollback that took `version` off `champion`, if that is the last thing that happened
    to it as champion (a later promotion, forced, makes it a champion again); else None."""
    with engine.connect() as conn:
        row = conn.execute(
            select(alias_moves)
            .where(
                and_(
                    alias_moves.c.model_name == model_name,
                    alias_moves.c.alias == "champion",
                    alias_moves.c.status == "done",
                    (alias_moves.c.from_version == version) | (alias_moves.c.to_version == version),
                )
            )
            .order_by(alias_moves.c.id.desc())
            .limit(1)
        ).first()
    return (
        MoveRecord.from_row(row) if row is not None and row.kind == "rollback" and row.from_version == version else None
    )


def superseded_by(engine: Engine, move: MoveRecord) -> int | None:
    """The id of a newer applied move of the same alias, if any: `move`'s event would be stale."""
    with engine.connect() as conn:
        return conn.execute(
            select(func.max(alias_moves.c.id)).where(
                and_(
                    alias_moves.c.model_name == move.model_name,
                    alias_moves.c.alias == move.alias,
                    alias_moves.c.status == "done",
                    alias_moves.c.id > move.id,
                )
            )
        ).scalar()


def last_move_to(engine: Engine, model_name: str, alias: str, version: str) -> MoveRecord | None:
    """The latest applied move of `alias` to `version` (when a canary went live)."""
    with engine.connect() as conn:
        row = conn.execute(
            select(alias_moves)
            .where(
                and_(
                    alias_moves.c.model_name == model_name,
                    alias_moves.c.alias == alias,
                    alias_moves.c.to_version == version,
                    alias_moves.c.status == "done",
                )
            )
            .order_by(alias_moves.c.id.desc())
            .limit(1)
        ).first()
    return MoveRecord.from_row(row) if row is not None else None


def complete_move(engine: Engine, move_id: int, status: str = "done") -> None:
    with engine.begin() as conn:
        conn.execute(update(alias_moves).where(alias_moves.c.id == move_id).values(status=status))


def mark_published(engine: Engine, move_id: int) -> None:
    with engine.begin() as conn:
        conn.execute(update(alias_moves).where(alias_moves.c.id == move_id).values(published_at=utcnow()))


def unfinished_moves(engine: Engine, model_name: str) -> list[MoveRecord]:
    """Pending moves, and done moves whose event was never published, oldest first."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(alias_moves)
            .where(
                and_(
                    alias_moves.c.model_name == model_name,
                    (alias_moves.c.status == "pending")
                    | ((alias_moves.c.status == "done") & alias_moves.c.published_at.is_(None)),
                )
            )
            .order_by(alias_moves.c.id)
        ).all()
    return [MoveRecord.from_row(r) for r in rows]


def moves(engine: Engine, model_name: str, limit: int = 50) -> list[MoveRecord]:
    """The newest moves first."""
    with engine.connect() as conn:
        rows = conn.execute(
            select(alias_moves)
            .where(alias_moves.c.model_name == model_name)
            .order_by(alias_moves.c.id.desc())
            .limit(limit)
        ).all()
    return [MoveRecord.from_row(r) for r in rows]
