"""The canary's sequential test: Wald's SPRT on the difference in mean reward, with boundaries
from Ville's inequality, so that it stays valid however often -- and whenever -- it is looked at.

    theta = mean episode reward of the canary - of the champion (the episode is the unit)
    H0: theta <= theta0 = -margin       worse than the non-inferiority margin: never promoted
    H1: theta >= theta1 = effect        the improvement the test is sized for (its power)

At each look the sides' mean difference d (CUPED-adjusted, below), with variance
V = s_b^2 / n_b + s_a^2 / n_a, is ~ N(theta, V) and carries the information I = 1 / V. The log
likelihood ratio of H1 to H0 is

    llr = (theta1 - theta0) * I * (d - (theta0 + theta1) / 2)

In information time I * d is a Brownian motion with drift theta, so exp(llr) is a martingale
under theta = theta0 (a supermartingale for any theta < theta0), and Ville's inequality bounds
its supremum: P(sup llr >= log(1/alpha)) <= alpha, over every look there will ever be. The
same holds for exp(-llr) under H1. So (Wald 1945; the bounds without Wald's approximation):

    promote    llr >= log(1 / alpha)       <=>  d >= mid + log(1/alpha) / ((theta1 - theta0) I)
    withdraw   llr <= log(beta)  futility  <=>  d <= mid + log(beta)    / ((theta1 - theta0) I)
    withdraw   both sides reached max_requests with neither: not shown to be within the margin

A canary worse than the margin is promoted with probability <= alpha; one at least `effect`
better is withdrawn by the futility boundary with probability <= beta (plus what truncation at
max_requests costs, measured in benchmarks/decisions.py). Looking more often only makes the
boundaries be met sooner, never wrongly more often. The variance is estimated at each look (a
normal approximation: min_requests a side before the first look); the error rates with
estimated variance and discrete rewards are measured by simulation (tests/unit/test_sequential.py).

Variance reduction (CUPED: Deng, Xu, Kohavi, Walker 2013). Each episode carries a covariate x
fixed before it was assigned to a side -- its prompt's (or user's) mean reward before the
canary went live -- and the outcome is adjusted by the part x predicts:

    y' = y - c * (x - mean(x)),    c = cov(y, x) / var(x)       pooled over both sides

Assignment is random and x is fixed before it, so x has the same distribution on both sides:
the adjusted difference estimates the same theta, with its variance reduced by 1 - rho^2
(rho: the correlation of y and x). Nothing the candidate's answer influences may be a covariate.

Nothing here touches a store or a registry: numbers in, a Look out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any, NamedTuple

import numpy as np

PROMOTE, WITHDRAW, TRUNCATED, CONTINUE = "promote", "withdraw", "truncated", "continue"


@dataclass(frozen=True)
class Design:
    """The test's parameters (RolloutConfig carries them: Design.of)."""

    margin: float  # theta0 = -margin
    effect: float  # theta1
    alpha: float  # false promotion of a canary worse than the margin
    beta: float  # futility withdrawal of a canary `effect` better
    min_n: int  # episodes a side before the first look
    max_n: int  # episodes a side at which the test stops undecided

    def __post_init__(self) -> None:
        if not self.effect > -self.margin:
            raise ValueError(f"the effect ({self.effect:+g}) must lie above -margin ({-self.margin:+g})")

    @property
    def theta0(self) -> float:
        return -self.margin

    @property
    def upper(self) -> float:
        return math.log(1 / self.alpha)

    @property
    def lower(self) -> float:
        return math.log(self.beta)

    @classmethod
    def of(cls, cfg: Any) -> Design:  # a RolloutConfig
        return cls(cfg.margin, cfg.effect, 1 - cfg.confidence, 1 - cfg.power, cfg.min_requests, cfg.max_requests)


@dataclass(frozen=True)
class Look:
    """One look at both sides: the estimate, where the boundaries lie now, what it says."""

    n_champion: int
    n_canary: int
    means: tuple[float, float]  # (champion's, canary's) mean reward, unadjusted
    difference: float  # canary - champion, CUPED-adjusted (nan before the first look)
    raw_difference: float  # unadjusted
    se: float  # sqrt(V) of the adjusted difference
    variance_reduction: float  # 1 - V_adjusted / V_raw (0: the covariate predicts nothing)
    llr: float
    promote_at: float  # the difference at or above which it promotes, at this information
    withdraw_at: float  # ... at or below which it withdraws (futility)
    verdict: str  # PROMOTE, WITHDRAW, TRUNCATED, CONTINUE
    expected_more: tuple[int, int]  # further (champion, canary) episodes expected to a decision

    def summary(self, design: Design) -> str:
        if math.isnan(self.difference):
            return (
                f"{self.n_canary} canary and {self.n_champion} champion episodes settled; the first look "
                f"needs {design.min_n} a side"
            )
        reduced = (
            f", variance -{100 * self.variance_reduction:.0f} % by the covariate"
            if self.variance_reduction > 0.005
            else ""
        )
        return (
            f"{self.n_canary} canary vs {self.n_champion} champion episodes: difference {self.difference:+.3f} "
            f"(se {self.se:.3f}{reduced}); promoted at >= {self.promote_at:+.3f}, withdrawn at <= "
            f"{self.withdraw_at:+.3f}; ~{self.expected_more[1]} more canary episodes expected "
            f"(at most {design.max_n} a side)"
        )


class Moments(NamedTuple):
    """One side's sufficient statistics: the episodes' count and the sums of y, y^2, x, x^2 and
    x*y (y: reward, x: covariate). Each field may be an array -- one entry per simulated run,
    as benchmarks/decisions.py and the tests use it: the same arithmetic decides either way."""

    n: Any
    sy: Any
    syy: Any
    sx: Any
    sxx: Any
    sxy: Any

    @classmethod
    def of(cls, y: Any, x: Any) -> Moments:
        y, x = np.asarray(y, dtype=np.float64), np.asarray(x, dtype=np.float64)
        return cls(len(y), y.sum(), (y * y).sum(), x.sum(), (x * x).sum(), (x * y).sum())


def statistic(a: Moments, b: Moments) -> tuple[Any, Any, Any, Any]:
    """(d, V, raw d, raw V): canary (b) minus champion (a), CUPED-adjusted by the pooled
    regression on the covariate (see the module docstring; none when the covariate does not vary)."""
    n = a.n + b.n
    mean_x, mean_y = (a.sx + b.sx) / n, (a.sy + b.sy) / n
    var_x = (a.sxx + b.sxx) / n - mean_x**2
    cov = (a.sxy + b.sxy) / n - mean_x * mean_y
    c = np.where(var_x > 1e-12, cov / np.where(var_x > 1e-12, var_x, 1.0), 0.0)

    def side(m: Moments) -> tuple[Any, Any, Any, Any]:
        # centred sums of squares and products of this side, ddof 1
        ssy, ssx, sxy = m.syy - m.sy**2 / m.n, m.sxx - m.sx**2 / m.n, m.sxy - m.sx * m.sy / m.n
        raw_mean, raw_var = m.sy / m.n, np.maximum(ssy, 0.0) / (m.n - 1)
        mean = raw_mean - c * (m.sx / m.n - mean_x)
        var = np.maximum(ssy - 2 * c * sxy + c**2 * ssx, 0.0) / (m.n - 1)
        return mean, var, raw_mean, raw_var

    mean_a, var_a, raw_a, raw_var_a = side(a)
    mean_b, var_b, raw_b, raw_var_b = side(b)
    return mean_b - mean_a, var_b / b.n + var_a / a.n, raw_b - raw_a, raw_var_b / b.n + raw_var_a / a.n


def llr(d: Any, var: Any, design: Design) -> Any:
    """The log likelihood ratio of H1 to H0 at difference d with variance var."""
    return (design.effect - design.theta0) * (d - (design.effect + design.theta0) / 2) / np.maximum(var, 1e-12)


def _expected_information(llr: float, drift: float, design: Design) -> float:
    """Expected further information until llr, a Brownian motion with `drift` and variance
    (theta1 - theta0)^2 per unit of information, leaves (lower, upper): the exit time of a
    drifted Brownian motion from an interval (its scale function s(y) = exp(-2 drift y / var))."""
    a, b, var = design.upper, design.lower, (design.effect - design.theta0) ** 2
    if abs(drift) * (a - b) / var < 1e-6:  # no drift: (a - x)(x - b) / var
        return (a - llr) * (llr - b) / var
    k = 2 * drift / var
    # P(exit at a) = (s(x) - s(b)) / (s(a) - s(b)), computed relative to the largest exponent
    ref = max(-k * a, -k * b, -k * llr)
    s = [math.exp(-k * v - ref) for v in (a, b, llr)]
    p_a = (s[2] - s[1]) / (s[0] - s[1])
    return max(0.0, (p_a * (a - llr) + (1 - p_a) * (b - llr)) / drift)


def look(champion: tuple[Any, Any], canary: tuple[Any, Any], design: Design) -> Look:
    """The test at this moment: `champion`, `canary` are (rewards, covariates) per episode."""
    a, b = Moments.of(*champion), Moments.of(*canary)
    n_a, n_b = a.n, b.n
    nan = float("nan")
    means = (float(a.sy / n_a) if n_a else nan, float(b.sy / n_b) if n_b else nan)  # (numpy scalars: not JSON)
    if min(n_a, n_b) < max(design.min_n, 2):
        return Look(
            n_a,
            n_b,
            means,
            nan,
            nan,
            nan,
            0.0,
            0.0,
            nan,
            nan,
            CONTINUE,
            (max(design.min_n - n_a, 0), max(design.min_n - n_b, 0)),
        )
    d, var, raw, raw_var = (float(v) for v in statistic(a, b))
    var = max(var, 1e-12)  # (identical constant rewards: no spread at all)
    span, mid = design.effect - design.theta0, (design.effect + design.theta0) / 2
    info, ratio = 1 / var, float(llr(d, var, design))
    if ratio >= design.upper:
        verdict = PROMOTE
    elif ratio <= design.lower:
        verdict = WITHDRAW
    elif min(n_a, n_b) >= design.max_n:
        verdict = TRUNCATED
    else:
        verdict = CONTINUE
    more = (0, 0)
    if verdict == CONTINUE:
        # at the current estimate, as the sides grow in their present proportion: V * n_b is
        # what one unit of information costs in canary episodes (V = (s_b^2 + s_a^2 / r) / n_b)
        more_b = min(_expected_information(ratio, span * (d - mid), design) * var * n_b, design.max_n - min(n_a, n_b))
        more = (max(0, math.ceil(more_b * n_a / n_b)), max(0, math.ceil(more_b)))
    return Look(
        n_a,
        n_b,
        means,
        d,
        raw,
        math.sqrt(var),
        max(0.0, 1 - var / raw_var) if raw_var > 0 else 0.0,
        ratio,
        mid + design.upper / (span * info),
        mid + design.lower / (span * info),
        verdict,
        more,
    )


def fixed_horizon_n(sd_champion: float, sd_canary: float, design: Design) -> int:
    """Episodes a side the one-look test at the same error rates needs: the one-sided alpha
    bound at -margin, power 1 - beta at `effect`, equal sides."""
    z = NormalDist().inv_cdf(1 - design.alpha) + NormalDist().inv_cdf(1 - design.beta)
    return math.ceil(z**2 * (sd_champion**2 + sd_canary**2) / (design.effect - design.theta0) ** 2)


def monitor(
    champion: tuple[np.ndarray, np.ndarray], canary: tuple[np.ndarray, np.ndarray], design: Design, every: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Simulated runs of the test, checked every `every` episodes a side from min_n on: each
    side is (rewards, covariates) as [R, N] arrays, runs by episodes in arrival order, the sides
    growing together. Returns, per run, the verdict that ended it (TRUNCATED: none by max_n, or
    by N when that is less -- CONTINUE then) and the episodes a side it had then."""
    (y_a, x_a), (y_b, x_b) = champion, canary
    runs, n_max = y_a.shape
    sums = [
        np.cumsum(v, axis=1)
        for v in (y_a, y_a * y_a, x_a, x_a * x_a, x_a * y_a, y_b, y_b * y_b, x_b, x_b * x_b, x_b * y_b)
    ]
    verdict = np.full(runs, CONTINUE, dtype=object)
    at = np.full(runs, min(n_max, design.max_n))
    open_ = np.ones(runs, dtype=bool)
    for n in range(max(design.min_n, 2), min(n_max, design.max_n) + 1, every):
        col = [s[:, n - 1] for s in sums]
        d, var, _, _ = statistic(Moments(n, *col[:5]), Moments(n, *col[5:]))
        ratio = llr(d, var, design)
        for hit, name in ((ratio >= design.upper, PROMOTE), (ratio <= design.lower, WITHDRAW)):
            ended = open_ & hit
            verdict[ended], at[ended] = name, n
            open_ &= ~ended
        if not open_.any():
            break
    if n_max >= design.max_n:
        verdict[open_] = TRUNCATED
    return verdict, at
