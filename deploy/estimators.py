"""The gate's estimators of (candidate - champion) reward, and which one decides.

    direct          fresh answers: for P held-out prompts each policy samples K answers at
                    serving's settings, the calibrated outcome model q scores every one, and
                        V(pi) = 1/P sum_p 1/K sum_k q(x_p, y_pk),   y_pk ~ pi(. | x_p)
                    The improvement's interval is a paired bootstrap over prompts (both policies'
                    answers to a prompt resampled together). It assumes q is right on the
                    answers the policies write now; it fails where they write answers unlike any
                    q learned from (a new kind of answer, a hack the reward never saw), and it
                    inherits q's bias: a miscalibrated model shifts both sides, a model that
                    cannot tell two kinds of answer apart hides their difference.
    doubly_robust   the direct estimate corrected by the logged episodes' importance-weighted
                    residuals (Dudik, Langford & Li 2011):
                        V(pi) = 1/N sum_i [ V_q(pi, x_i) + w_i (r_i - q(x_i, y_i)) ]
                        w_i = min(pi(y_i|x_i) / mu(y_i|x_i), cap)
                    over the logged episodes whose prompt the policies answered afresh. Right if
                    either q or the weights are; where the policy left the logged answers (small
                    coverage) the correction sees little and it is the direct estimate again.
    importance      the logged episodes alone (deploy/offpolicy.py): SNIS and plain IS, the lower
                    bound of the two. Assumes the logged answers cover the policy: biased upward
                    for a candidate that drifted off them (SNIS renormalises the mass it lost).

Every evaluation records all three (an estimator that could not be computed says why);
`gate.estimator` names the one the improvement check reads. The direct and doubly robust ones
need a usable outcome model: without one the gate falls back to importance sampling
(`gate.fallback`) or refuses, and its check says which and why -- never a silent pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from deploy.gate import Estimate
from deploy.offpolicy import _interval, clipped_weights

NEEDS_OUTCOME_MODEL = ("direct", "doubly_robust")


@dataclass
class Estimated:
    """One estimator's improvement, or why it has none."""

    name: str
    improvement: Estimate | None
    n: int = 0  # prompts (direct) or logged episodes (the others) it rests on
    diagnostics: dict[str, float] = field(default_factory=dict)  # each side's value, ess, coverage
    why_not: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _bootstrap(diff: np.ndarray, resamples: int, confidence: float, seed: int) -> Estimate:
    """Mean of per-unit differences [U] and its percentile bootstrap interval over units."""
    idx = np.random.default_rng(seed).integers(0, len(diff), size=(resamples, len(diff)))  # [R, U]
    return _interval(diff[idx].mean(axis=1), float(diff.mean()), confidence)


def prompt_means(scores: Sequence[Sequence[float | None]]) -> np.ndarray:
    """[P] each prompt's mean score over its answers (nan where none was scored)."""
    out = np.full(len(scores), np.nan)
    for p, row in enumerate(scores):
        values = [v for v in row if v is not None]
        if values:
            out[p] = float(np.mean(values))
    return out


def direct(
    candidate: np.ndarray, champion: np.ndarray, resamples: int = 1000, confidence: float = 0.95, seed: int = 0
) -> Estimated:
    """`candidate`, `champion`: [P] the mean outcome-model score of each policy's fresh answers
    to prompt p (nan: none scored; that prompt is left out)."""
    keep = ~(np.isnan(candidate) | np.isnan(champion))
    if not keep.any():
        return Estimated("direct", None, why_not="no held-out prompt was answered and scored by both policies")
    c, h = candidate[keep], champion[keep]
    return Estimated(
        "direct",
        _bootstrap(c - h, resamples, confidence, seed),
        int(keep.sum()),
        {"candidate": float(c.mean()), "champion": float(h.mean())},
    )


def doubly_robust(
    v_candidate: np.ndarray,
    v_champion: np.ndarray,
    predicted: np.ndarray,
    rewards: np.ndarray,
    candidate_logp: np.ndarray,
    champion_logp: np.ndarray,
    behavior_logp: np.ndarray,
    cap: float = 20.0,
    resamples: int = 1000,
    confidence: float = 0.95,
    seed: int = 0,
) -> Estimated:
    """Per logged episode i [N]: each policy's direct value at its prompt (v_*), the outcome
    model's prediction of its logged answer, its reward, and the sequence log-probs of that
    answer under each policy and the behaviour. Episodes with a nan are left out."""
    arrays = [v_candidate, v_champion, predicted, rewards, candidate_logp, champion_logp, behavior_logp]
    keep = ~np.any([np.isnan(a) for a in arrays], axis=0)
    if not keep.any():
        return Estimated(
            "doubly_robust",
            None,
            why_not="no logged held-out episode's prompt was answered afresh by both policies and scored",
        )
    vc, vh, q, r, lc, lh, mu = (a[keep] for a in arrays)
    w_c, w_h = clipped_weights(lc, mu, cap), clipped_weights(lh, mu, cap)
    dr_c, dr_h = vc + w_c * (r - q), vh + w_h * (r - q)  # [N]
    return Estimated(
        "doubly_robust",
        _bootstrap(dr_c - dr_h, resamples, confidence, seed),
        int(keep.sum()),
        {
            "candidate": float(dr_c.mean()),
            "champion": float(dr_h.mean()),
            "coverage_candidate": float(w_c.mean()),
            "coverage_champion": float(w_h.mean()),
            "residual_mean": float((r - q).mean()),
        },
    )


@dataclass
class Choice:
    """The estimate the improvement check reads, which estimator it came from, and why that one."""

    estimator: str
    improvement: Estimate | None
    note: str  # empty when the configured estimator decides; else the fallback and its reason
    refused: bool = False  # gate.fallback = "refuse" and the configured estimator could not decide


def choose(estimates: dict[str, Estimated], wanted: str, fallback: str, outcome_model: str) -> Choice:
    """`outcome_model`: "" when a usable one scored the answers, else why there is none."""
    chosen = estimates.get(wanted)
    if chosen is not None and chosen.improvement is not None:
        return Choice(wanted, chosen.improvement, "")
    why = chosen.why_not if chosen is not None else f"{wanted} was not computed"
    if wanted in NEEDS_OUTCOME_MODEL and outcome_model:
        why = f"the outcome model {outcome_model}"
    if fallback == "refuse" or wanted == "importance":
        return Choice(
            wanted, None, f"{wanted} could not be computed ({why}) and gate.fallback = '{fallback}'", refused=True
        )
    backup = estimates.get("importance")
    return Choice(
        "importance",
        backup.improvement if backup else None,
        f"fell back to importance sampling: {wanted} could not be computed ({why})",
    )
