"""The gate: a pure function from two evaluation reports and the configured limits to a decision.

A candidate replaces the champion only if every check passes:

    smoke        the candidate loads and generates
    ess          the importance-sampling estimate rests on enough effective samples (when it is
                 the estimator that decides; else recorded only)
    estimator    the configured estimator decided, or the fallback and why (deploy/estimators.py)
    improvement  the lower confidence bound of (candidate - champion) reward > min_improvement
    regression   no regression-suite item that the champion passes fails for the candidate
    kl           KL(champion || candidate) per token within budget
    bound:<m>    every bounded metric (canaries, length, latency, ...) within its absolute
                 limits and its allowed change from the champion, in the named direction

First deployment (no champion): `first_deployment = "base"` (the default) passes the base
model's report as the champion -- it is what serves until the first promotion, so a first
candidate must beat it like any other; "absolute" applies only the checks that need no
champion (smoke, ess, absolute bounds, every regression item passing) and records the
comparative ones as not applicable; "refuse" fails the gate so that a human promotes by hand.
A champion (or, on a first deployment, the base model) that failed to generate cannot be
compared with: the gate fails closed (check `champion_measured`) and every relative bound whose
champion value is missing fails, rather than passing as not applicable.
Nothing here touches a model, a store or a registry: the same inputs give the same decision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pipeline.core.config import Bound, GateConfig


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float  # confidence interval
    high: float


@dataclass
class EvalReport:
    """What evaluation measured for one policy (deploy/evaluate.py)."""

    version: str  # registry version, "candidate", or "base"
    reward: Estimate  # off-policy estimate on held-out episodes
    ess: float  # effective sample size of that estimate
    metrics: dict[str, float] = field(default_factory=dict)  # canaries, mean_length, smoke_latency_ms, ...
    regression: dict[str, bool] = field(default_factory=dict)  # suite item -> passed
    smoke_ok: bool = True
    smoke_error: str | None = None


@dataclass
class Comparison:
    improvement: Estimate  # candidate - champion reward, by `estimator` (deploy/estimators.py)
    kl: float  # KL(champion || candidate) per token on the eval prompts
    estimator: str = "importance"  # which estimator `improvement` came from
    note: str = ""  # why that one, when it is not the configured one (a fallback), or why none decided
    estimates: dict[str, Any] = field(default_factory=dict)  # every estimator's improvement, or why none
    refused: bool = False  # no estimator could decide under gate.fallback: the gate fails


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    value: float | None = None
    limit: float | None = None
    applicable: bool = True


@dataclass
class Decision:
    passed: bool
    checks: list[Check]
    first_deployment: bool

    @property
    def reasons(self) -> list[str]:
        return [c.detail for c in self.checks if not c.passed]

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "first_deployment": self.first_deployment,
            "checks": [asdict(c) for c in self.checks],
        }


# Metrics a first deployment is not compared on: the base model serves with no adapter, so a
# candidate's latency against it is the cost of serving any LoRA adapter, not a regression of this
# one. From the second deployment on, champion and candidate both carry one and are compared.
ADAPTER_COST_METRICS = ("smoke_latency_ms",)


def _bound_checks(
    name: str,
    bound: Bound,
    cand: float | None,
    champ: float | None,
    no_baseline: str = "no champion to compare with",
    champion_measured: bool = False,
) -> list[Check]:
    """`champion_measured`: there is a champion, so a missing value of it is a failure to
    measure (fail closed), not the absence of a baseline."""
    key = f"bound:{name}"
    if cand is None:
        return [Check(key, False, f"{name} was not measured for the candidate")]
    out = []
    if bound.min is not None:
        out.append(Check(key, cand >= bound.min, f"{name} {cand:.4g} (min {bound.min:.4g})", cand, bound.min))
    if bound.max is not None:
        out.append(Check(key, cand <= bound.max, f"{name} {cand:.4g} (max {bound.max:.4g})", cand, bound.max))
    changes = [
        ("max_increase", lambda: cand - champ),
        ("max_decrease", lambda: champ - cand),
        ("max_rel_increase", lambda: (cand - champ) / abs(champ)),
        ("max_rel_decrease", lambda: (champ - cand) / abs(champ)),
    ]
    for attr, change in changes:
        limit = getattr(bound, attr)
        if limit is None:
            continue
        if champ is None and champion_measured:
            out.append(Check(key, False, f"{name} {attr}: not measured for the champion, nothing to compare with"))
            continue
        if champ is None:
            out.append(Check(key, True, f"{name} {attr}: {no_baseline}", applicable=False))
            continue
        if attr.startswith("max_rel") and champ == 0:
            out.append(Check(key, True, f"{name} {attr}: the champion's value is 0", applicable=False))
            continue
        delta = change()
        out.append(
            Check(
                key,
                delta <= limit,
                f"{name} {attr.removeprefix('max_').replace('_', ' ')} "
                f"{delta:.4g} vs champion {champ:.4g} (limit {limit:.4g})",
                delta,
                limit,
            )
        )
    return out


def decide(
    candidate: EvalReport,
    champion: EvalReport | None,
    comparison: Comparison | None,
    cfg: GateConfig,
    first: bool = False,
) -> Decision:
    """`champion` None: the first deployment without a baseline; `first` with a champion report:
    the first deployment compared with the base model (first_deployment = "base")."""
    first = first or champion is None
    by_importance = comparison is None or comparison.estimator == "importance"
    checks = [
        Check(
            "smoke",
            candidate.smoke_ok,
            "candidate loads and generates"
            if candidate.smoke_ok
            else f"candidate failed to load or generate: {candidate.smoke_error}",
        ),
        Check(
            "ess",
            candidate.ess >= cfg.min_ess,
            f"effective sample size {candidate.ess:.1f} (min {cfg.min_ess:.1f})",
            candidate.ess,
            cfg.min_ess,
        )
        if by_importance
        else Check(
            "ess",
            True,
            f"effective sample size {candidate.ess:.1f} of importance sampling, which does not decide "
            f"({comparison.estimator} does)",
            candidate.ess,
            cfg.min_ess,
            applicable=False,
        ),
    ]
    if champion is None:
        checks.append(
            Check(
                "first_deployment",
                cfg.first_deployment != "refuse",
                "no champion: gated on absolute limits"
                if cfg.first_deployment != "refuse"
                else "no champion and gate.first_deployment = 'refuse': promote by hand",
            )
        )
        checks.append(Check("improvement", True, "no champion to improve on", applicable=False))
        checks.append(Check("kl", True, "no champion to diverge from", applicable=False))
        failing = sorted(k for k, ok in candidate.regression.items() if not ok)
        checks.append(
            Check(
                "regression",
                not failing,
                f"regression items failing: {', '.join(failing)}"
                if failing
                else f"all {len(candidate.regression)} regression items pass",
            )
        )
    else:
        if first:
            checks.append(Check("first_deployment", True, "no champion: compared with the base model"))
        if not champion.smoke_ok:
            checks.append(
                Check(
                    "champion_measured",
                    False,
                    f"the {'base model' if first else 'champion'} failed to "
                    f"generate ({champion.smoke_error}): no comparison is possible; fix it or promote "
                    "by hand",
                )
            )
        if comparison is None:
            checks.append(Check("improvement", False, "no comparison with the champion was measured"))
        else:
            if comparison.note:  # a fallback (passes, and says so) or a refusal for want of an estimator
                checks.append(Check("estimator", not comparison.refused, comparison.note))
            lcb = comparison.improvement.low
            checks.append(
                Check(
                    "improvement",
                    lcb > cfg.min_improvement,
                    f"reward improvement {comparison.improvement.value:+.4f}, lower bound {lcb:+.4f} "
                    f"(must exceed {cfg.min_improvement:+.4f}; {comparison.estimator})",
                    lcb,
                    cfg.min_improvement,
                )
            )
            checks.append(
                Check(
                    "kl",
                    comparison.kl <= cfg.max_kl,
                    f"KL(champion || candidate) {comparison.kl:.4f} per token (max {cfg.max_kl:.4f})",
                    comparison.kl,
                    cfg.max_kl,
                )
            )
        newly = sorted(k for k, ok in candidate.regression.items() if not ok and champion.regression.get(k, True))
        checks.append(
            Check(
                "regression",
                not newly,
                f"regression items newly failing: {', '.join(newly)}" if newly else "no regression item newly failing",
            )
        )
    for name, bound in sorted(cfg.bounds.items()):
        if first and name in ADAPTER_COST_METRICS:
            checks.extend(
                _bound_checks(
                    name,
                    bound,
                    candidate.metrics.get(name),
                    None,
                    "the base model serves without an adapter (compared from the next deployment)",
                )
            )
            continue
        champ = champion.metrics.get(name) if champion else None
        checks.extend(
            _bound_checks(name, bound, candidate.metrics.get(name), champ, champion_measured=champion is not None)
        )
    return Decision(passed=all(c.passed for c in checks), checks=checks, first_deployment=first)
