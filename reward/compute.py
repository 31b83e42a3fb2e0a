"""One episode -> one reward, with every component kept.

    reward = clip( sum over kinds k in the spec of  weight_k * combine_k(signal_k(event) ...)
                                                   (each x 0.5 ** (delay / half_life_k) if set)
                   + judge weight * (2 * judge score - 1)          (when the spec has a judge)
                   - sum over guards of penalty )

Feedback events are ordered by (ts, event_id) before combining, so the result does not depend
on the order they arrived in. Kinds the spec does not name contribute nothing (and are listed
as ignored). An episode is ripe once `ripeness.window_s` has passed since the interaction, or
a terminal kind has arrived.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from itertools import groupby
from operator import itemgetter
from typing import NamedTuple

from reward.guards import GUARDS
from reward.signals import COMBINE, SIGNALS, Episode, Feedback, SignalFn, decayed, numeric
from reward.spec import RewardSpec


class RewardResult(NamedTuple):
    value: float
    components: dict[str, float]  # "signal.accepted": 0.5, "guard.abstention": -0.6, ...
    ignored_kinds: tuple[str, ...] = ()

    @property
    def unclipped(self) -> float:
        return sum(self.components.values())


def is_ripe(ep: Episode, spec: RewardSpec, now: datetime) -> bool:
    return Scorer(spec).is_ripe(ep, now)


# Feedback fields, read by position: these keys run for every event of a million-episode run
_KIND_TIME_ID = itemgetter(1, 3, 0)  # (kind, ts, event_id)
_EVENT_ID = itemgetter(0)
_KIND = itemgetter(1)


def _by_kind_in_time_order(feedback: tuple) -> Iterator[tuple[str, Iterator[Feedback]]]:
    """(kind, its events by (ts, event_id)) for each kind, kinds in name order: a total order,
    since event ids are unique (the store dedupes on them). Episodes built by hand may repeat an
    id; their ties are broken by the content, so the result never depends on the order events
    arrived or were read in."""
    if len(feedback) < 2:
        return groupby(feedback, _KIND)
    if len(set(map(_EVENT_ID, feedback))) == len(feedback):
        return groupby(sorted(feedback, key=_KIND_TIME_ID), _KIND)
    return groupby(sorted(feedback, key=lambda fb: (fb.kind, fb.ts, fb.event_id, repr(fb.value),
                                                    json.dumps(fb.payload, sort_keys=True, default=str))), _KIND)


def _signal_fn(kind: str, half_life_s: float | None) -> SignalFn:
    fn = SIGNALS.get(kind, numeric)
    return fn if half_life_s is None else decayed(fn, half_life_s)


class Scorer:
    """`compute_reward` for one spec, with the spec's lookups done once: the reward stage scores
    up to a million episodes per run with one of these."""

    def __init__(self, spec: RewardSpec):
        self.spec = spec
        # kind -> (component name, weight, combine (None: the last event's value), per-event signal)
        self.signals = {kind: (f"signal.{kind}", sig.weight, None if sig.combine == "last" else COMBINE[sig.combine],
                               _signal_fn(kind, sig.half_life_s)) for kind, sig in spec.signals.items()}
        self.guards = [(f"guard.{name}", guard, getattr(spec.guards, name)) for name, guard in GUARDS.items()]
        self.judge_weight = spec.judge.weight if spec.judge is not None else None
        self.lo, self.hi = spec.clip.min, spec.clip.max
        self.window = timedelta(seconds=spec.ripeness.window_s)
        self.terminal = frozenset(spec.ripeness.terminal_kinds)

    def is_ripe(self, ep: Episode, now: datetime) -> bool:
        return self.ripeness(now)(ep)

    def ripeness(self, now: datetime) -> Callable[[Episode], bool]:
        """`is_ripe` at one `now`, as a predicate with the window's cutoff computed once."""
        cutoff, terminal = now - self.window, self.terminal

        def ripe(ep: Episode) -> bool:
            return ep.ts <= cutoff or any(fb.kind in terminal for fb in ep.feedback)

        return ripe

    def __call__(self, ep: Episode, judge_score: float | None = None) -> RewardResult:
        components: dict[str, float] = {}
        ignored = []
        signals = self.signals
        for kind, events in _by_kind_in_time_order(ep.feedback):
            sig = signals.get(kind)
            if sig is None:
                ignored.append(kind)
                continue
            name, weight, combine, fn = sig
            if combine is None:
                # "last" reads only the newest event: an edit superseded by a later one costs nothing
                for newest in events:
                    pass
                value = fn(newest, ep)
            else:
                value = combine([fn(fb, ep) for fb in events])
            components[name] = weight * value
        if self.judge_weight is not None and judge_score is not None:
            components["judge.score"] = self.judge_weight * (2 * judge_score - 1)
        for name, guard, params in self.guards:
            penalty = guard(ep, params)
            if penalty:
                components[name] = -penalty
        total = sum(components.values())
        return RewardResult(min(self.hi, max(self.lo, total)), components, tuple(ignored))


def compute_reward(ep: Episode, spec: RewardSpec, judge_score: float | None = None) -> RewardResult:
    """`judge_score` in (0, 1) from the spec's judge, when it has one (see judge.py)."""
    return Scorer(spec)(ep, judge_score)
