"""Staged rollout: the online comparison that decides whether a canary becomes the champion.

The gate decides from logged episodes (deploy/offpolicy.py), and that estimate can be
optimistic: it cannot see the probability a candidate puts on completions the champion never
produced -- the candidate's own mistakes (README, "Known limitation"). With `rollout.share` > 0
a candidate that passed the gate first serves that share of live requests under the registry
alias `canary`, the champion serving the rest, and the users' reactions decide:

    a request goes to the canary  iff  hash(request_id) < share       (routes_to_canary)
    once both sides have >= min_requests settled requests since the canary went live (served
    at least the spec's ripeness window ago, so every outcome is in; pipeline/cycle.py):
        d  = mean_canary - mean_champion                 rewards under the current spec
        se = sqrt(var_canary / n_canary + var_champion / n_champion)           (Welch)
        promote  iff  d - z(confidence) * se >= -margin   (non-inferiority, one-sided)
    no such data within max_wait: withdrawn, never promoted unmeasured

Both sides are served over the same period from the same traffic, assigned at random, so the
difference is a randomised experiment's: no importance weights, no model of the users. The
comparison is made once, at the fixed sample size: re-testing as data arrives and stopping at
the first pass would let a worse canary through far more often than 1 - confidence.
Nothing here touches a model, a store or a registry.
"""

from __future__ import annotations

import hashlib
import math
from statistics import NormalDist

from deploy.gate import Check, Decision
from pipeline.core.config import RolloutConfig

Side = tuple[int, float, float]  # rewarded requests, mean reward, sample variance


def routes_to_canary(request_id: str, share: float) -> bool:
    """The canary serves this request: a stable hash of its id below `share` (the same request id
    always goes the same way; over many ids, `share` of them go to the canary)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < share


def ready(champion: Side | None, canary: Side | None, cfg: RolloutConfig) -> bool:
    """Both sides have the requests the comparison is sized for."""
    return all(side is not None and side[0] >= cfg.min_requests for side in (champion, canary))


def decide(champion: Side, canary: Side, cfg: RolloutConfig) -> Decision:
    """The one comparison, on both sides' rewards since the canary went live."""
    (n_a, mean_a, var_a), (n_b, mean_b, var_b) = champion, canary
    diff = mean_b - mean_a
    se = math.sqrt(var_b / n_b + var_a / n_a)
    z = NormalDist().inv_cdf(cfg.confidence)
    low = diff - z * se
    passed = low >= -cfg.margin
    detail = (f"online reward: canary {mean_b:+.3f} (n={n_b}) vs champion {mean_a:+.3f} (n={n_a}), difference "
              f"{diff:+.3f}, {100 * cfg.confidence:.0f} % lower bound {low:+.3f} "
              f"{'>=' if passed else '<'} -{cfg.margin:g}")
    checks = [Check("online.requests", True, f"{n_b} canary and {n_a} champion requests settled",
                    float(min(n_a, n_b)), float(cfg.min_requests)),
              Check("online.reward", passed, detail, low, -cfg.margin)]
    return Decision(passed, checks, first_deployment=False)


def too_little_traffic(champion: Side | None, canary: Side | None, cfg: RolloutConfig) -> Decision:
    """max_wait passed without the requests the comparison needs: the canary is withdrawn."""
    n_a, n_b = (champion or (0, 0.0, 0.0))[0], (canary or (0, 0.0, 0.0))[0]
    detail = (f"online: only {n_b} canary and {n_a} champion requests settled within rollout.max_wait "
              f"({cfg.max_wait}); {cfg.min_requests} each are needed -- raise rollout.share or max_wait")
    return Decision(False, [Check("online.requests", False, detail, float(min(n_a, n_b)), float(cfg.min_requests))],
                    first_deployment=False)
