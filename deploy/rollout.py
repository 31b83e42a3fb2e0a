"""Staged rollout: the online comparison that decides whether a canary becomes the champion.

The gate decides from logged episodes (deploy/offpolicy.py), and that estimate can be
optimistic: it cannot see the probability a candidate puts on completions the champion never
produced -- the candidate's own mistakes (README, "Known limitation"). With `rollout.share` > 0
a candidate that passed the gate first serves that share of live requests under the registry
alias `canary`, the champion serving the rest, and the users' reactions decide:

    a request goes to the canary  iff  hash_salt(episode_id or request_id) < share   (routes_to_canary;
      the salt a server-side secret: only the router decides, never the client)
      (every call of an agent's episode goes the same way: a canary is measured as a whole
      agent, never as the first call of an episode the champion finishes)
    once both sides have >= min_requests settled episodes since the canary went live (served
    at least the spec's ripeness window ago, so every outcome is in; pipeline/cycle.py):
        d  = mean_canary - mean_champion                 rewards under the current spec, an
                                                         episode's calls averaged into one unit
        se = sqrt(var_canary / n_canary + var_champion / n_champion)           (Welch)
        promote  iff  d - z(confidence) * se >= -margin   (non-inferiority, one-sided)
    and the online tool-format canary, on the calls both sides served in the same period (every
    call, not only those that wrote a tool call: never fewer than the min_requests episodes):
        p  = (errors + 1) / (calls + 2) per side               (Agresti-Caffo: a side with no
        e  = p_canary - p_champion                               broken call is not certain)
        refuse  iff  e - z(confidence) * se_e > max_tool_error_increase      (binomial se of the p)
      (a reward spec blind to broken tool calls -- Cursor's first production reward hack --
      pays the canary that writes them; the users' rewards alone would promote it)
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

Side = tuple[int, float, float]  # rewarded episodes (a request without one: its own), mean reward, variance
Calls = tuple[int, int]  # calls served, calls that wrote a malformed tool call


def routes_to_canary(key: str, share: float, salt: str = "") -> bool:
    """The canary serves this request: a stable hash of `key` -- the request's episode id when
    it names one, else its request id -- below `share` (the same key always goes the same way, so
    an episode's calls all go to one version; over many keys, `share` of them go to the canary).
    `salt`: the server's secret and the canary's version (routing_salt): without it a client
    could pick an episode id that hashes to the side it wants, and the comparison would no longer
    be a randomised one."""
    secret = hashlib.blake2b(salt.encode()).digest() if salt else b""  # (a key of any length: 64 bytes)
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=secret).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64 < share


def routing_salt(secret: str, canary: str | None) -> str:
    """What salts the canary's hash: the deployment's RTRL_ROUTING_SECRET (the same for every
    replica of the gateway and of rtrl serve, so that an episode's calls agree) and the canary's
    version (each canary draws its own sample of episodes)."""
    return f"{secret}|v{canary}" if secret else ""


def routing_signature(secret: str, request_id: str, routed: str, model: str | None) -> str:
    """A router's proof, to the server behind it, that it chose the version (rtrl gateway in
    front of rtrl serve): a keyed hash of the request's id and the choice -- no secret on the
    wire, and a client that cannot compute it cannot choose."""
    message = f"{request_id}|{routed}|{model or ''}".encode()
    return hashlib.blake2b(message, key=hashlib.blake2b(secret.encode()).digest(), digest_size=16).hexdigest()


def ready(champion: Side | None, canary: Side | None, cfg: RolloutConfig) -> bool:
    """Both sides have the requests the comparison is sized for."""
    return all(side is not None and side[0] >= cfg.min_requests for side in (champion, canary))


def decide(champion: Side, canary: Side, cfg: RolloutConfig,
           tool_calls: tuple[Calls, Calls] | None = None) -> Decision:
    """The one comparison, on both sides' rewards since the canary went live (and, with
    `tool_calls` -- (champion's, canary's) -- their tool-call error rates)."""
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
    if tool_calls is not None and cfg.max_tool_error_increase is not None:
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
    return Check("online.tool_format_error_rate", passed,
                 f"online tool-call errors: canary {100 * rate_b:.1f} % of {n_b} calls vs champion "
                 f"{100 * rate_a:.1f} % of {n_a}, increase lower bound {100 * low:+.1f} pp "
                 f"{'<=' if passed else '>'} {100 * max_increase:g} pp", low, max_increase)


def too_little_traffic(champion: Side | None, canary: Side | None, cfg: RolloutConfig) -> Decision:
    """max_wait passed without the requests the comparison needs: the canary is withdrawn."""
    n_a, n_b = (champion or (0, 0.0, 0.0))[0], (canary or (0, 0.0, 0.0))[0]
    detail = (f"online: only {n_b} canary and {n_a} champion requests settled within rollout.max_wait "
              f"({cfg.max_wait}); {cfg.min_requests} each are needed -- raise rollout.share or max_wait")
    return Decision(False, [Check("online.requests", False, detail, float(min(n_a, n_b)), float(cfg.min_requests))],
                    first_deployment=False)
