"""Looking at rewards before adopting a spec, and at production canaries per policy version.

    diff_specs   one pass over ripe episodes, scoring each under two specs: distributions,
                 per-signal contributions, sign changes, the biggest movers
    audit        per policy version: abstention rate, mean output length, tool-error rate,
                 accept rate, follow-up rate -- the production canaries the gate compares

Both stream: memory is bounded by a fixed-size reservoir (quantiles) and a top-k heap.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import Engine

from pipeline.core.store.episode_reads import iter_episode_chunks
from pipeline.core.store.events import utcnow
from pipeline.core.store.online import served_and_accepted
from pipeline.core.textchecks import is_abstention
from reward.compute import RewardResult, Scorer
from reward.scoring import PAYLOAD_KINDS, build_episode
from reward.signals import Episode
from reward.spec import RewardSpec

_RESERVOIR = 50_000


def iter_episodes(engine: Engine, spec_version: str = "") -> Iterator[Episode]:
    for chunk in iter_episode_chunks(engine, spec_version, payload_kinds=PAYLOAD_KINDS):
        for row in chunk.interactions:
            yield build_episode(row)


@dataclass
class Distribution:
    """Exact count/mean/std/min/max (Welford); quantiles from a seeded reservoir sample."""

    n: int = 0
    mean: float = 0.0
    _m2: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    _sample: list[float] = field(default_factory=list)
    _rng: random.Random = field(default_factory=lambda: random.Random(0))

    def add(self, x: float) -> None:
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self._m2 += delta * (x - self.mean)
        self.min, self.max = min(self.min, x), max(self.max, x)
        if len(self._sample) < _RESERVOIR:
            self._sample.append(x)
        elif (j := self._rng.randrange(self.n)) < _RESERVOIR:
            self._sample[j] = x

    @property
    def std(self) -> float:
        return math.sqrt(self._m2 / self.n) if self.n else 0.0

    def quantile(self, q: float) -> float:
        if not self._sample:
            return math.nan
        ordered = sorted(self._sample)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _sign(x: float) -> int:
    return (x > 1e-12) - (x < -1e-12)


@dataclass
class SpecDiff:
    old_version: str
    new_version: str
    old: Distribution = field(default_factory=Distribution)
    new: Distribution = field(default_factory=Distribution)
    contributions: dict[str, list[float]] = field(default_factory=dict)  # name -> [old sum, new sum]
    sign_changes: int = 0
    changed: int = 0
    movers: list[tuple[float, str, float, float]] = field(default_factory=list)  # heap of (|d|, id, old, new)

    def add(self, ep: Episode, old: RewardResult, new: RewardResult, top: int) -> None:
        self.old.add(old.value)
        self.new.add(new.value)
        for which, result in ((0, old), (1, new)):
            for name, value in result.components.items():
                self.contributions.setdefault(name, [0.0, 0.0])[which] += value
        self.sign_changes += _sign(old.value) != _sign(new.value)
        delta = abs(new.value - old.value)
        self.changed += delta > 1e-12
        item = (delta, ep.request_id, old.value, new.value)
        if len(self.movers) < top:
            heapq.heappush(self.movers, item)
        elif item > self.movers[0]:
            heapq.heapreplace(self.movers, item)


def diff_specs(
    engine: Engine, old: RewardSpec, new: RewardSpec, now: datetime | None = None, top: int = 10
) -> SpecDiff:
    """How rewards of ripe episodes (ripe under the new spec) would change from `old` to `new`."""
    now = now or utcnow()
    out = SpecDiff(old.version, new.version)
    score_old, score_new = Scorer(old), Scorer(new)
    for ep in iter_episodes(engine):
        if score_new.is_ripe(ep, now):
            out.add(ep, score_old(ep), score_new(ep), top)
    return out


@dataclass
class Canaries:
    """Production canary rates of one policy version (fractions of its episodes)."""

    episodes: int = 0
    abstentions: int = 0
    chars: int = 0
    tool_errors: int = 0
    accepted: int = 0
    followups: int = 0

    def rates(self) -> dict[str, float]:
        n = max(self.episodes, 1)
        return {
            "abstention_rate": self.abstentions / n,
            "mean_length": self.chars / n,
            "tool_error_rate": self.tool_errors / n,
            "accept_rate": self.accepted / n,
            "followup_rate": self.followups / n,
        }


def audit(engine: Engine, spec: RewardSpec) -> dict[str, Canaries]:
    """Canary counts per policy version over every stored episode (ripe or not)."""
    out: dict[str, Canaries] = {}
    patterns = spec.guards.abstention.patterns
    for ep in iter_episodes(engine):
        c = out.setdefault(ep.policy_version, Canaries())
        kinds = {fb.kind for fb in ep.feedback if fb.value > 0}
        c.episodes += 1
        c.abstentions += is_abstention(ep.text, patterns)
        c.chars += len(ep.text)
        c.tool_errors += "tool_error" in kinds
        c.followups += "followup" in kinds
    for version, (_, accepted) in served_and_accepted(engine, list(out)).items():
        out[version].accepted = accepted  # the headline figure has one definition: the store's
    return out
