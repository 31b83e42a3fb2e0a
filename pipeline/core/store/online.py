"""Online reads: what each policy version served and how its users answered -- the canary's
sequential test (online_units, tool_call_errors), the policy metrics' accept rates
(served_and_accepted, accepts_over_time) and who captured the traffic (served_by). The gate's
decisions and the alias moves they lead to are in deploys.py."""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any, NamedTuple

import orjson
from sqlalchemy import Engine, and_, case, cast, exists, func, literal, select
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.sql.selectable import Exists

from pipeline.core.store.episodes import wrote_malformed_call
from pipeline.core.store.tables import feedback, interactions, rewards


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
