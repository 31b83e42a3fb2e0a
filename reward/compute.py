"""One episode -> one reward, with every component kept.

    reward = clip( sum over kinds k in the spec of  weight_k * combine_k(signal_k(event) ...)
                                                   (each x 0.5 ** (delay / half_life_k) if set)
                   + judge weight * (2 * judge score - 1)          (when the spec has a judge)
                   - sum over guards of penalty )

Feedback events are ordered by (ts, event_id) before combining, so the result does not depend
on the order they arrived in. Kinds the spec does not name contribute nothing (and are listed
as ignored). An episode is ripe once `ripeness.window_s` has passed since the interaction, or
a terminal kind has arrived.

A call of an agent episode (calls sharing an `episode_id`) adds its share of the episode's
outcome -- the feedback naming the episode, scored by the same signals -- to its own reward:

    reward(call) = clip( own signals + judge - own guards
                         + credit(call) * sum over kinds k of weight_k * combine_k(outcome_k) )
    credit(call) = 1                                  spec [episode] credit = "equal"
                 = gamma ** (calls after this one)    credit = "discounted"

so a guard still lands on the call it concerns (a malformed tool call in step 3 costs step 3),
and the outcome that arrives once, after many calls, reaches every one of them. Such a call is
ripe when its episode is: a terminal kind of the outcome arrived, or `[episode] window_s`
(default: ripeness.window_s) has passed since the episode's last call.
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
from reward.spec import EpisodeCredit, RewardSpec


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
    return groupby(
        sorted(
            feedback,
            key=lambda fb: (
                fb.kind,
                fb.ts,
                fb.event_id,
                repr(fb.value),
                json.dumps(fb.payload, sort_keys=True, default=str),
            ),
        ),
        _KIND,
    )


def _signal_fn(kind: str, half_life_s: float | None) -> SignalFn:
    fn = SIGNALS.get(kind, numeric)
    return fn if half_life_s is None else decayed(fn, half_life_s)


class Scorer:
    """`compute_reward` for one spec, with the spec's lookups done once: the reward stage scores
    up to a million episodes per run with one of these."""

    def __init__(self, spec: RewardSpec):
        self.spec = spec
        # kind -> (component name, weight, combine (None: the last event's value), per-event signal)
        self.signals = {
            kind: (
                f"signal.{kind}",
                sig.weight,
                None if sig.combine == "last" else COMBINE[sig.combine],
                _signal_fn(kind, sig.half_life_s),
            )
            for kind, sig in spec.signals.items()
        }
        self.guards = [(f"guard.{name}", guard, getattr(spec.guards, name)) for name, guard in GUARDS.items()]
        self.judge_weight = spec.judge.weight if spec.judge is not None else None
        self.lo, self.hi = spec.clip.min, spec.clip.max
        self.window = timedelta(seconds=spec.ripeness.window_s)
        self.terminal = frozenset(spec.ripeness.terminal_kinds)
        episode = spec.episode or EpisodeCredit()
        self.gamma = episode.gamma if episode.credit == "discounted" else 1.0
        self.episode_window = timedelta(seconds=episode.window_s or spec.ripeness.window_s)

    def is_ripe(self, ep: Episode, now: datetime) -> bool:
        return self.ripeness(now)(ep)

    def ripeness(self, now: datetime) -> Callable[[Episode], bool]:
        """`is_ripe` at one `now`, as a predicate with the window's cutoff computed once."""
        cutoff, terminal, episode_cutoff = now - self.window, self.terminal, now - self.episode_window

        def ripe(ep: Episode) -> bool:
            if ep.episode_id is not None:
                return ep.last_call_ts <= episode_cutoff or any(fb.kind in terminal for fb in ep.outcome)
            return ep.ts <= cutoff or any(fb.kind in terminal for fb in ep.feedback)

        return ripe

    @staticmethod
    def finished(ep: Episode) -> bool:
        """Whether a call's agent episode got an outcome (any feedback naming the episode): the
        reward stage reports episodes that ripened by their window with none."""
        return bool(ep.outcome)

    def credit(self, ep: Episode) -> float:
        """The share of its episode's outcome a call gets (see the module docstring)."""
        return self.gamma**ep.calls_after

    def __call__(self, ep: Episode, judge_score: float | None = None) -> RewardResult:
        components: dict[str, float] = {}
        ignored: list[str] = []
        self._signals(ep, ep.feedback, components, ignored, "", 1.0)
        if ep.outcome:
            self._signals(ep, ep.outcome, components, ignored, "episode.", self.credit(ep))
        if self.judge_weight is not None and judge_score is not None:
            components["judge.score"] = self.judge_weight * (2 * judge_score - 1)
        for name, guard, params in self.guards:
            penalty = guard(ep, params)
            if penalty:
                components[name] = -penalty
        total = sum(components.values())
        return RewardResult(min(self.hi, max(self.lo, total)), components, tuple(ignored))

    def _signals(
        self, ep: Episode, feedback: tuple, components: dict[str, float], ignored: list[str], prefix: str, scale: float
    ) -> None:
        """The spec's signals over `feedback` (the call's own, or its episode's outcome with the
        call's credit as `scale`) into `components`, named `prefix` + "signal.<kind>"."""
        signals = self.signals
        for kind, events in _by_kind_in_time_order(feedback):
            sig = signals.get(kind)
            if sig is None:
                ignored.append(kind)
                continue
            name, weight, combine, fn = sig
            if combine is None:
                # "last" reads only the newest event: an edit superseded by a later one costs nothing
                for newest in events:  # noqa: B007 -- exhausting the group leaves its newest in `newest`
                    pass
                value = fn(newest, ep)
            else:
                value = combine([fn(fb, ep) for fb in events])
            components[prefix + name] = scale * weight * value


def compute_reward(ep: Episode, spec: RewardSpec, judge_score: float | None = None) -> RewardResult:
    """`judge_score` in (0, 1) from the spec's judge, when it has one (see judge.py)."""
    return Scorer(spec)(ep, judge_score)
