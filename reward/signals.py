"""Signals: one small pure function per feedback kind, all in one registry.

Each maps one feedback event (and its episode) to a value in [-1, 1]; the sign says good or
bad, the spec's weight says how much, the spec's `combine` folds repeated events of a kind.
Kinds without a function here use `numeric` (the event's value, clipped), so any kind a
producer invents can be weighted by name in a spec.

    {"kind": "accepted", "value": true}                      accepted  -> +1
    {"kind": "edited", "payload": {"text": "<user's edit>"}} edited    -> 2 * similarity - 1
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import NamedTuple

from rapidfuzz.distance import Levenshtein


class Feedback(NamedTuple):
    event_id: str
    kind: str
    value: float  # booleans as 1.0 / 0.0
    ts: datetime
    payload: object = None


class Episode(NamedTuple):
    """An interaction (one call) with the feedback joined to it (by request_id), ready to be
    scored; for a call of an agent episode (several calls sharing an `episode_id`) also the
    episode's outcome (the feedback naming the episode) and the call's place in it. A call
    without an episode id is an episode of its own. (Named tuples, not dataclasses: the reward
    stage builds a million of them per run.)"""

    request_id: str
    ts: datetime
    policy_version: str
    text: str  # the assistant's output (all assistant turns of a trajectory, joined)
    tool_calls: tuple = ()  # every tool call the assistant made, as sent
    feedback: tuple[Feedback, ...] = ()
    expects_attempt: bool = True
    prompt_text: str = ""  # the request, rendered as text (for a judge)
    episode_id: str | None = None  # the agent episode; None: this call is its own episode
    outcome: tuple[Feedback, ...] = ()  # feedback on the whole episode (by episode_id)
    calls_after: int = 0  # calls of the episode after this one (0: the last call)
    episode_calls: int = 1  # calls in the episode (as stored: a duplicate interaction counts)
    last_call_ts: datetime | None = None  # when the episode's last call was served


SignalFn = Callable[[Feedback, Episode], float]
SIGNALS: dict[str, SignalFn] = {}


def signal(kind: str) -> Callable[[SignalFn], SignalFn]:
    def register(fn: SignalFn) -> SignalFn:
        SIGNALS[kind] = fn
        return fn

    return register


def _clip(x: float) -> float:
    return max(-1.0, min(1.0, x))


@signal("accepted")
def accepted(fb: Feedback, ep: Episode) -> float:
    """The user took the suggestion. `{"value": true}` -> +1; false -> 0 (not a rejection)."""
    return 1.0 if fb.value > 0 else 0.0


@signal("rejected")
def rejected(fb: Feedback, ep: Episode) -> float:
    """The user dismissed it. `{"value": true}` -> -1."""
    return -1.0 if fb.value > 0 else 0.0


def edit_text(payload: object) -> str | None:
    if isinstance(payload, str):
        return payload
    if isinstance(payload, dict) and isinstance(payload.get("text"), str):
        return payload["text"]
    return None


@signal("edited")
def edited(fb: Feedback, ep: Episode) -> float:
    """The user kept an edited version. `{"payload": {"text": ...}}` -> 2 * similarity - 1, where
    similarity = 1 - Levenshtein distance / length of the longer text: +1 when the edit is the
    completion unchanged, -1 when nothing of it survived ("abc" edited to "abd" -> +1/3).
    Without the edited text, the event's value (a similarity in [0, 1]) is used the same way."""
    text = edit_text(fb.payload)
    if text is None:
        return _clip(2 * fb.value - 1)
    return 2 * Levenshtein.normalized_similarity(ep.text, text) - 1


@signal("persisted")
def persisted(fb: Feedback, ep: Episode) -> float:
    """Minutes later the change is still there. `{"value": true}` -> +1; false (reverted) -> -1."""
    return 1.0 if fb.value > 0 else -1.0


@signal("followup")
def followup(fb: Feedback, ep: Episode) -> float:
    """A dissatisfied follow-up ("that's wrong, ..."). `{"value": true}` -> -1."""
    return -1.0 if fb.value > 0 else 0.0


@signal("thumbs")
def thumbs(fb: Feedback, ep: Episode) -> float:
    """Explicit rating. `{"value": true}` or `1` -> +1; `false`, `0` or `-1` -> -1."""
    return 1.0 if fb.value > 0 else -1.0


@signal("tool_error")
def tool_error(fb: Feedback, ep: Episode) -> float:
    """A tool call failed when executed. `{"value": true}` or a count `2` -> -1 (per event)."""
    return -1.0 if fb.value > 0 else 0.0


@signal("test_result")
def test_result(fb: Feedback, ep: Episode) -> float:
    """Tests after the change. `{"value": true}` -> +1, false -> -1, a pass rate p -> 2p - 1."""
    return _clip(2 * fb.value - 1)


def numeric(fb: Feedback, ep: Episode) -> float:
    """Any other kind: its value, clipped to [-1, 1]. `{"kind": "csat", "value": 0.4}` -> 0.4."""
    return _clip(fb.value)


def decayed(fn: SignalFn, half_life_s: float) -> SignalFn:
    """`fn` with each event's value scaled by 0.5 ** (delay / half_life_s), the delay being the
    time from the interaction to the event (0 if the event claims to be earlier). With
    `half_life_s = 600`, a follow-up 10 minutes after the suggestion -> -1 * 0.5 = -0.5; one
    within seconds -> about -1. Decay never changes a value's sign, only shrinks it."""

    def signal(fb: Feedback, ep: Episode) -> float:
        delay_s = max(0.0, (fb.ts - ep.ts).total_seconds())
        return fn(fb, ep) * 0.5 ** (delay_s / half_life_s)

    signal.__doc__ = fn.__doc__
    return signal


COMBINE: dict[str, Callable[[list[float]], float]] = {
    "last": lambda xs: xs[-1],
    "sum": sum,
    "max": max,
    "min": min,
    "mean": lambda xs: sum(xs) / len(xs),
}
