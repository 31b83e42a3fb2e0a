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

import hashlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from sqlalchemy import CursorResult, Engine, and_, case, cast, exists, func, literal, select, update
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.selectable import Exists

from pipeline.core.store.episodes import wrote_malformed_call
from pipeline.core.store.events import utcnow
from pipeline.core.store.leases import Fence
from pipeline.core.store.tables import alias_moves, feedback, gate_decisions, interactions, rewards


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


def _accepted() -> Exists:
    """Whether an interaction was accepted: at least one `accepted` event with a positive value."""
    return exists().where(
        and_(feedback.c.request_id == interactions.c.request_id, feedback.c.kind == "accepted", feedback.c.value > 0)
    )


def accepts_over_time(engine: Engine) -> list[tuple[datetime, str, bool]]:
    """Every interaction as (served at, policy version, accepted), oldest first: the accept rate
    of served_and_accepted, over time (the demo's report buckets it by minute)."""
    stmt = select(interactions.c.ts, interactions.c.policy_version, case((_accepted(), 1), else_=0)).order_by(
        interactions.c.ts
    )
    with engine.connect() as conn:
        return [(ts, version, bool(a)) for ts, version, a in conn.execute(stmt)]


def served_and_accepted(engine: Engine, versions: list[str] | None = None) -> dict[str, tuple[int, int]]:
    """Per policy version (all of them with None): requests it served, and how many of them a
    user accepted -- at least one `accepted` event with a true (positive) value; an `accepted`
    event with a false value is no accept. The one definition of the headline figure, the
    online accept rate: the daemon's gauge, `rtrl reward audit` and the demo's report read it
    here. Versions that served nothing are left out."""
    if versions is not None and not versions:
        return {}
    stmt = select(interactions.c.policy_version, func.count(), func.sum(case((_accepted(), 1), else_=0))).group_by(
        interactions.c.policy_version
    )
    if versions is not None:
        stmt = stmt.where(interactions.c.policy_version.in_(versions))
    with engine.connect() as conn:
        return {version: (served, int(n)) for version, served, n in conn.execute(stmt)}


class OnlineUnits(NamedTuple):
    """A version's settled episodes in a canary's window, aligned: each one's reward and the
    covariate the sequential test adjusts it by (deploy/sequential.py)."""

    rewards: list[float]
    covariates: list[float]

    def summary(self) -> tuple[int, float, float]:
        """(n, mean, sample variance) of the rewards."""
        n = len(self.rewards)
        mean = sum(self.rewards) / n if n else 0.0
        return n, mean, sum((v - mean) ** 2 for v in self.rewards) / max(n - 1, 1)


def _prompt_key(body: str) -> str:
    """A digest of an interaction's prompt (its body's `prompt`, whatever its shape); "" when the
    body does not parse -- such a call gets the history's overall mean as its covariate."""
    try:
        prompt = orjson.loads(body).get("prompt")
        return hashlib.blake2b(orjson.dumps(prompt, option=orjson.OPT_SORT_KEYS), digest_size=12).hexdigest()
    except (orjson.JSONDecodeError, orjson.JSONEncodeError, AttributeError, TypeError):
        return ""


def _episodes(rows: Any, covariate: str) -> dict[tuple[str, str, str], tuple[list[float], str]]:
    """(version, tenant, unit) -> (its calls' rewards, the covariate key of its first call): rows
    of (version, tenant, unit, step, ts, user_id, body, reward). The first call's prompt or user
    is what the user brought before any answer: no later call's prompt (which holds the policy's
    own answers) may be a covariate."""
    out: dict[tuple[str, str, str], tuple[list[float], tuple[Any, ...], str]] = {}
    for version, tenant, unit, step, ts, user, body, value in rows:
        key = (version, tenant, unit)
        order = (step is None, step or 0, ts)
        rewards, first, first_key = out.get(key, ([], None, ""))
        rewards.append(float(value))
        if first is None or order < first:
            first, first_key = (
                order,
                (user if covariate == "user" else _prompt_key(body) if covariate == "prompt" else ""),
            )
        out[key] = (rewards, first, first_key)
    return {k: (r, key) for k, (r, _, key) in out.items()}


def online_units(
    engine: Engine,
    spec_version: str,
    versions: list[str],
    since: datetime,
    until: datetime | None = None,
    covariate: str = "none",
    history: int = 0,
) -> dict[str, OnlineUnits]:
    """Per policy version: its episodes served from `since` to `until`, each one's mean call
    reward under `spec_version` -- a staged rollout's online comparison, both sides over the same
    period. An episode counts once whatever its number of calls (an agent that calls a tool more
    does not weigh more, and calls of one episode are not independent draws); a request without
    an episode id is its own. Only rewarded requests count; versions with none are left out.

    `covariate` ("prompt", "user" or "none") and `history`: each episode's covariate is the mean
    reward, among the `history` most recent rewarded calls served before `since` (whatever
    served them: before the canary, so nothing it did), of the episodes that began with the same
    prompt (or user) -- the overall mean of those for a key never seen, 0 without any."""
    window = [interactions.c.ts >= since] + ([interactions.c.ts <= until] if until is not None else [])
    # driven by the window (the ts index), each reward found by its request: the cost follows the
    # window, not the history (an index on the rewards' policy_version would make SQLite read
    # every reward the champion ever had; docs/benchmarks.md has the figures)
    unit = func.coalesce(interactions.c.episode_id, interactions.c.request_id)  # (an episode: of its tenant)
    body = interactions.c.body if covariate == "prompt" else literal("")  # (prompts are most of a body)
    columns = (
        rewards.c.policy_version,
        interactions.c.tenant,
        unit,
        interactions.c.step,
        interactions.c.ts,
        interactions.c.user_id,
        body,
        rewards.c.value,
    )
    joined = interactions.join(rewards, rewards.c.request_id == interactions.c.request_id)
    stmt = (
        select(*columns)
        .select_from(joined)
        .where(*window, rewards.c.spec_version == spec_version, rewards.c.policy_version.in_(versions))
    )
    before = (
        select(*columns)
        .select_from(joined)
        .where(interactions.c.ts < since, rewards.c.spec_version == spec_version)
        .order_by(interactions.c.ts.desc())
        .limit(history)
    )
    with engine.connect() as conn:
        served = _episodes(conn.execute(stmt), covariate)
        past = _episodes(conn.execute(before), covariate) if covariate != "none" and history > 0 else {}
    by_key: dict[str, list[float]] = {}
    for calls, key in past.values():
        by_key.setdefault(key, []).append(sum(calls) / len(calls))
    every = [v for values in by_key.values() for v in values]
    overall = sum(every) / len(every) if every else 0.0
    means = {key: sum(v) / len(v) for key, v in by_key.items() if key}
    out: dict[str, OnlineUnits] = {}
    for (version, _, _), (calls, key) in served.items():
        units = out.setdefault(version, OnlineUnits([], []))
        units.rewards.append(sum(calls) / len(calls))
        units.covariates.append(means.get(key, overall))
    return out


def tool_call_errors(
    engine: Engine, versions: list[str], since: datetime, until: datetime | None = None
) -> dict[str, tuple[int, int]]:
    """Per policy version: calls it served from `since` to `until`, and how many of them wrote a
    malformed tool call (store.episodes.wrote_malformed_call: one a server flagged, no name,
    arguments that are no JSON object) -- a staged rollout's online tool-format canary.
    Versions that served nothing are left out."""
    window = [interactions.c.ts >= since, interactions.c.policy_version.in_(versions)] + (
        [interactions.c.ts <= until] if until is not None else []
    )
    with engine.connect() as conn:
        served: dict[str, int] = dict(
            conn.execute(
                select(interactions.c.policy_version, func.count())
                .where(*window)
                .group_by(interactions.c.policy_version)
            ).all()
        )
        with_calls = conn.execute(
            select(interactions.c.policy_version, interactions.c.output_tool_calls).where(
                *window, interactions.c.output_tool_calls.is_not(None)
            )
        ).all()
    errors: dict[str, int] = {}
    for version, calls in with_calls:
        if wrote_malformed_call(calls):
            errors[version] = errors.get(version, 0) + 1
    return {version: (int(n), errors.get(version, 0)) for version, n in served.items()}


def served_by(engine: Engine) -> dict[str, dict[str, int]]:
    """Interactions per server that sent them (`metadata.server`: rtrl-serve, rtrl-gateway, ...;
    "" when unnamed) and policy version: who captured the traffic, and how it was routed."""
    if engine.dialect.name == "sqlite":
        server = func.json_extract(interactions.c.body, "$.metadata.server")
    else:
        server = cast(interactions.c.body, JSONB)["metadata"]["server"].astext
    out: dict[str, dict[str, int]] = {}
    with engine.connect() as conn:
        for name, version, n in conn.execute(
            select(server, interactions.c.policy_version, func.count()).group_by(server, interactions.c.policy_version)
        ):
            out.setdefault(name or "", {})[version] = n
    return out
