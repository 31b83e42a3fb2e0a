"""Staged rollout: the online test that decides whether a canary becomes the champion.

The gate decides before any user sees the candidate, and its estimate can be optimistic (the
probability a candidate puts on answers that were never served is beyond it; docs/concepts.md).
With `rollout.share` > 0 a candidate that passed the gate first serves that share of live
requests under the registry alias `canary`, the champion serving the rest, and the users'
reactions decide:

    a request goes to the canary  iff  hash_salt(episode_id or request_id) < share   (the router's:
      deploy/serving/routing.py;
      the salt a server-side secret: only the router decides, never the client)
      (every call of an agent's episode goes the same way: a canary is measured as a whole
      agent, never as the first call of an episode the champion finishes)
    at every check (the daemon's, every rollout.check_every), on the episodes both sides served
    since the canary went live and whose outcomes are final (the spec's ripeness window passed):
        each episode's reward (its calls' mean: the episode is the unit) and its covariate (its
        first prompt's -- or user's -- mean reward before the canary went live: CUPED)
        look = deploy/sequential.py's SPRT: promote / withdraw (futility) / truncated / continue
    when the reward test promotes, the online tool-format canary, on the calls both sides
    served in the same period (every call, not only those that wrote a tool call):
        p  = (errors + 1) / (calls + 2) per side               (Agresti-Caffo: a side with no
        e  = p_canary - p_champion                               broken call is not certain)
        refuse  iff  e - z(confidence) * se_e > max_tool_error_increase      (binomial se of the p)
      (a reward spec blind to broken tool calls -- Cursor's first production reward hack --
      pays the canary that writes them; the users' rewards alone would promote it)
    no decision within max_wait: withdrawn, never promoted unmeasured

Both sides are served over the same period from the same traffic, assigned at random, so the
difference is a randomised experiment's: no importance weights, no model of the users. The
test is sequential and valid under continuous monitoring (its boundaries are Ville's), so the
daemon may look as often as it likes: a canary well above or below the margin is decided after
a fraction of the episodes a fixed-size test needs (benchmarks/decisions.py).
Nothing here touches a model, a store or a registry.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

from deploy import sequential
from deploy.gate import Check, Decision
from deploy.sequential import PROMOTE, WITHDRAW, Design, Look
from pipeline.core.config import RolloutConfig

Units = tuple[Sequence[float], Sequence[float]]  # per settled episode: its reward, its covariate
Calls = tuple[int, int]  # calls served, calls that wrote a malformed tool call


def look(champion: Units | None, canary: Units | None, cfg: RolloutConfig) -> Look:
    """The sequential test on what each side has settled so far (None: nothing yet)."""
    empty: Units = ([], [])
    return sequential.look(champion or empty, canary or empty, Design.of(cfg))


def decide(seen: Look, cfg: RolloutConfig, tool_calls: tuple[Calls, Calls] | None = None) -> Decision:
    """The decision of a look that ended the test (its verdict is not CONTINUE) -- and, with
    `tool_calls` ((champion's, canary's) served and broken), the tool-call error rates when it
    would promote."""
    design = Design.of(cfg)
    n_a, n_b = seen.n_champion, seen.n_canary
    mean_a, mean_b = seen.means
    adjusted = (
        f" ({seen.raw_difference:+.3f} unadjusted, variance -{100 * seen.variance_reduction:.0f} % by the "
        f"{cfg.covariate} covariate)"
        if seen.variance_reduction > 0.005
        else ""
    )
    head = (
        f"online reward: canary {mean_b:+.3f} (n={n_b}) vs champion {mean_a:+.3f} (n={n_a}), difference "
        f"{seen.difference:+.3f}{adjusted}"
    )
    if seen.verdict == PROMOTE:
        why = (
            f"{head} >= {seen.promote_at:+.3f}, the sequential test's promotion boundary: not worse than "
            f"-{cfg.margin:g} (at most {100 * design.alpha:g} % of canaries worse than that pass)"
        )
        value, limit = seen.difference, seen.promote_at
    elif seen.verdict == WITHDRAW:
        why = (
            f"{head} <= {seen.withdraw_at:+.3f}, the sequential test's futility boundary: not shown to be "
            f"within -{cfg.margin:g} (a canary {cfg.effect:+g} better ends here at most "
            f"{100 * design.beta:g} % of the time)"
        )
        value, limit = seen.difference, seen.withdraw_at
    else:
        why = (
            f"{head}: neither boundary (promoted at >= {seen.promote_at:+.3f}, withdrawn at <= "
            f"{seen.withdraw_at:+.3f}) after rollout.max_requests ({cfg.max_requests}) a side: not shown to "
            f"be within -{cfg.margin:g}"
        )
        value, limit = seen.difference, seen.promote_at
    checks = [
        Check(
            "online.requests",
            True,
            f"{n_b} canary and {n_a} champion episodes settled",
            float(min(n_a, n_b)),
            float(cfg.min_requests),
        ),
        Check("online.reward", seen.verdict == PROMOTE, why, value, limit),
    ]
    if seen.verdict == PROMOTE and tool_calls is not None and cfg.max_tool_error_increase is not None:
        z = NormalDist().inv_cdf(cfg.confidence)
        checks.append(tool_format_check(*tool_calls, cfg.max_tool_error_increase, z))
    return Decision(all(c.passed for c in checks), checks, first_deployment=False)


def tool_format_check(champion: Calls, canary: Calls, max_increase: float, z: float) -> Check:
    """The canary writes no more broken tool calls than the champion, beyond `max_increase` --
    refused only when the lower bound of the increase is above it (noise does not refuse). The
    bound is Agresti and Caffo's (2000): one broken and one good call added to each side before
    the Wald interval, which keeps its coverage when a side has few or no broken calls -- the
    plain Wald bound takes a champion with 0 broken of 90 calls as certain (its se 0), and refused
    a canary with 6 of 130 (a demo run's v1)."""
    (n_a, e_a), (n_b, e_b) = champion, canary
    rate_a, rate_b = e_a / max(n_a, 1), e_b / max(n_b, 1)
    p_a, p_b = (e_a + 1) / (n_a + 2), (e_b + 1) / (n_b + 2)
    se = math.sqrt(p_a * (1 - p_a) / (n_a + 2) + p_b * (1 - p_b) / (n_b + 2))
    low = p_b - p_a - z * se
    passed = low <= max_increase
    return Check(
        "online.tool_format_error_rate",
        passed,
        f"online tool-call errors: canary {100 * rate_b:.1f} % of {n_b} calls vs champion "
        f"{100 * rate_a:.1f} % of {n_a}, increase lower bound {100 * low:+.1f} pp "
        f"{'<=' if passed else '>'} {100 * max_increase:g} pp",
        low,
        max_increase,
    )


def too_little_traffic(seen: Look, cfg: RolloutConfig) -> Decision:
    """max_wait passed before the test decided: the canary is withdrawn."""
    detail = (
        f"online: no decision within rollout.max_wait ({cfg.max_wait}): {seen.summary(Design.of(cfg))} "
        "-- raise rollout.share or max_wait"
    )
    return Decision(
        False,
        [Check("online.requests", False, detail, float(min(seen.n_champion, seen.n_canary)), float(cfg.min_requests))],
        first_deployment=False,
    )
