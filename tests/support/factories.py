"""Builders for contract-v1 events, shared by tests and benchmarks."""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta

BASE_TS = datetime(2026, 11, 1, tzinfo=UTC)


def interaction(i: int, *, prefix: str = "ev", size: int = 0, rng: random.Random | None = None, **over) -> dict:
    """An interaction event; `size` pads the completion so the JSON is about that many bytes."""
    rng = rng or random.Random(i)
    completion = " ".join(rng.choice(["def", "return", "x", "+", "1", "print", "(", ")"]) for _ in range(12))
    ev = {
        "schema_version": 1,
        "event_id": f"{prefix}-i-{i}",
        "type": "interaction",
        "ts": (BASE_TS + timedelta(seconds=i)).isoformat().replace("+00:00", "Z"),
        "request_id": f"{prefix}-r-{i}",
        "session_id": f"s-{i % 97}",
        "user_id": f"u-{i % 31}",
        "tenant": "acme",
        "policy_version": "1",
        "prompt": [{"role": "user", "content": f"task {i}: reverse the string abc{i}"}],
        "completion": completion,
        "completion_token_ids": [rng.randrange(1000) for _ in range(12)],
        "behavior_logprobs": [round(-rng.random() * 3, 6) for _ in range(12)],
        "sampling": {"temperature": 0.8, "top_p": 0.95},
        "latency_ms": 41.5,
        "metadata": {"client": "ide", "region": "eu"},
    }
    ev.update(over)
    if size:
        pad = size - len(json.dumps(ev))
        if pad > 0:
            ev["metadata"] = dict(ev["metadata"], context="x" * pad)
    return ev


def feedback(i: int, *, prefix: str = "ev", kind: str = "accepted", value=True, **over) -> dict:
    ev = {
        "schema_version": 1,
        "event_id": f"{prefix}-f-{i}",
        "type": "feedback",
        "ts": (BASE_TS + timedelta(seconds=i, milliseconds=500)).isoformat().replace("+00:00", "Z"),
        "request_id": f"{prefix}-r-{i}",
        "kind": kind,
        "value": value,
    }
    ev.update(over)
    return ev


def encode(ev: dict) -> bytes:
    return json.dumps(ev).encode("utf-8")


def served_now(prefix: str, version: str, n: int, good: float) -> list[dict]:
    """`n` requests served by policy `version` now, a `good` share of them kept by the user
    (persisted, a terminal signal: rewarded at once) and the rest reverted -- a canary's or a
    champion's live traffic."""
    rng = random.Random(prefix)
    now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
    events = []
    for i in range(n):
        events.append(interaction(i, prefix=prefix, policy_version=version, ts=now))
        events.append(feedback(i, prefix=prefix, kind="persisted", value=rng.random() < good, ts=now))
    return events
