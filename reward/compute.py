"""One episode -> one reward, with every component kept.

    reward = clip( sum over kinds k in the spec of  weight_k * combine_k(signal_k(event) ...)
                   + judge weight * (2 * judge score - 1)          (when the spec has a judge)
                   - sum over guards of penalty )

Feedback events are ordered by (ts, event_id) before combining, so the result does not depend
on the order they arrived in. Kinds the spec does not name contribute nothing (and are listed
as ignored). An episode is ripe once `ripeness.window_s` has passed since the interaction, or
a terminal kind has arrived.
"""

from __future__ import annotations

import json

from dataclasses import dataclass
from datetime import datetime, timedelta

from reward.guards import GUARDS
from reward.signals import COMBINE, SIGNALS, Episode, numeric
from reward.spec import RewardSpec


@dataclass(frozen=True)
class RewardResult:
    value: float
    components: dict[str, float]  # "signal.accepted": 0.5, "guard.abstention": -0.6, ...
    ignored_kinds: tuple[str, ...] = ()

    @property
    def unclipped(self) -> float:
        return sum(self.components.values())


def is_ripe(ep: Episode, spec: RewardSpec, now: datetime) -> bool:
    if now - ep.ts >= timedelta(seconds=spec.ripeness.window_s):
        return True
    terminal = set(spec.ripeness.terminal_kinds)
    return any(fb.kind in terminal for fb in ep.feedback)


def _order(fb) -> tuple:
    return (fb.ts, fb.event_id, fb.kind, repr(fb.value), json.dumps(fb.payload, sort_keys=True, default=str))


def compute_reward(ep: Episode, spec: RewardSpec, judge_score: float | None = None) -> RewardResult:
    """`judge_score` in (0, 1) from the spec's judge, when it has one (see judge.py)."""
    by_kind: dict[str, list] = {}
    # a total order (ties on time and id broken by the content): the result never depends on
    # the order events arrived or were read in
    for fb in sorted(ep.feedback, key=_order):
        by_kind.setdefault(fb.kind, []).append(fb)
    components: dict[str, float] = {}
    ignored = []
    for kind, events in sorted(by_kind.items()):
        sig = spec.signals.get(kind)
        if sig is None:
            ignored.append(kind)
            continue
        fn = SIGNALS.get(kind, numeric)
        components[f"signal.{kind}"] = sig.weight * COMBINE[sig.combine]([fn(fb, ep) for fb in events])
    if spec.judge is not None and judge_score is not None:
        components["judge.score"] = spec.judge.weight * (2 * judge_score - 1)
    for name, guard in GUARDS.items():
        penalty = guard(ep, spec.guards)
        if penalty:
            components[f"guard.{name}"] = -penalty
    total = sum(components.values())
    value = min(spec.clip.max, max(spec.clip.min, total))
    return RewardResult(value=value, components=components, ignored_kinds=tuple(ignored))
