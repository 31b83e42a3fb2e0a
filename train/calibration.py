"""Calibration of an outcome model's scores, and the figures that say how good it is.

An outcome model (train/outcome.py) scores an answer with a number that orders answers but need
not be a reward: isotonic regression (the pool-adjacent-violators algorithm, Ayer et al. 1955;
Zadrozny & Elkan 2002 for classifier scores) fits the monotone map from score to reward that
is closest in squared error on a slice the model never trained on. Its output at a score is the
mean reward of the calibration episodes around that score, so the calibrated prediction is an
estimate of E[reward | score] -- what the gate's direct estimate averages.

The figures, on a slice neither the model nor the calibration saw, with rewards r scaled to
[0, 1] by the range the model was fitted on:

    auroc              P(pred_i > pred_j | r_i > r_j) over pairs of different rewards (ties 1/2):
                       the AUROC for 0/1 rewards, Harrell's concordance for graded ones
    brier              mean (pred - r)^2; `brier_baseline` is that of predicting the mean reward
    calibration_error  the debiased L2 calibration error over 10 equal-count bins of predictions
                       (Kumar, Liang & Ma 2019, "Verified Uncertainty Calibration"): the square
                       root of sum (bin share) [(mean pred - mean r)^2 - var(r - pred) / n_bin],
                       0 when that is negative. The plain binned error, sum (bin share)
                       |mean pred - mean r| (Naeini et al. 2015), counts each bin's sampling noise
                       as miscalibration: on a check slice of ~160 episodes it averages ~0.06 for
                       a model calibrated by construction, so a limit of 0.05 refuses most good
                       models on a small store; the debiased error subtracts that noise's
                       expectation and measures what is systematic.
    r2                 1 - brier / brier_baseline: the share of the reward's variance explained
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Isotonic:
    """A non-decreasing step function: knots x (ascending) and their values y; between knots
    it interpolates, outside them it holds the end values."""

    x: tuple[float, ...]
    y: tuple[float, ...]

    @classmethod
    def fit(cls, scores: np.ndarray, targets: np.ndarray) -> Isotonic:
        order = np.argsort(scores, kind="stable")
        s, t = np.asarray(scores, float)[order], np.asarray(targets, float)[order]
        # pool adjacent violators: blocks [sum, count, first score, last score], merged while a
        # block's mean is not above the one before it
        blocks: list[list[float]] = []
        for score, target in zip(s, t):
            blocks.append([target, 1, score, score])
            while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] >= blocks[-1][0] / blocks[-1][1]:
                last = blocks.pop()
                blocks[-1][0] += last[0]
                blocks[-1][1] += last[1]
                blocks[-1][3] = last[3]
        xs, ys = [], []
        for total, n, a, b in blocks:  # each block's ends carry its mean
            xs += [a, b] if b > a else [a]
            ys += [total / n] * (2 if b > a else 1)
        return cls(tuple(float(v) for v in xs), tuple(float(v) for v in ys))

    def __call__(self, scores: np.ndarray) -> np.ndarray:
        return np.interp(np.asarray(scores, float), self.x, self.y)


def _ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    _, first, counts = np.unique(x[order], return_index=True, return_counts=True)
    for start, n in zip(first[counts > 1], counts[counts > 1]):
        ranks[order[start : start + n]] = start + (n + 1) / 2
    return ranks


def auroc(pred: np.ndarray, target: np.ndarray) -> float:
    """Concordance of predictions with targets (see the module docstring); nan when every
    target is the same. Each pair (i, j) with target_i > target_j is counted once, at the level
    v = target_j: the Mann-Whitney statistic of the episodes above v against those at v."""
    pred, target = np.asarray(pred, float), np.asarray(target, float)
    levels = np.unique(target)
    if len(levels) < 2:
        return float("nan")
    concordant, pairs = 0.0, 0.0
    for v in levels[:-1]:
        both = target >= v
        high = target[both] > v
        n_high, n_low = int(high.sum()), int((~high).sum())
        concordant += _ranks(pred[both])[high].sum() - n_high * (n_high + 1) / 2
        pairs += n_low * n_high
    return float(concordant / pairs)


def calibration_error(pred: np.ndarray, target: np.ndarray, bins: int = 10) -> float:
    """The debiased L2 calibration error (see the module's docstring); nan with fewer than two
    predictions a bin."""
    pred, target = np.asarray(pred, float), np.asarray(target, float)
    if len(pred) < 2:
        return float("nan")
    order = np.argsort(pred, kind="stable")
    squared = 0.0
    for chunk in np.array_split(order, min(bins, len(order) // 2)):
        # the bin's mean residual squared overstates its square by the mean's variance,
        # var(residual) / n: subtract the unbiased estimate of that
        residual = target[chunk] - pred[chunk]
        squared += len(chunk) / len(order) * (residual.mean() ** 2 - residual.var(ddof=1) / len(chunk))
    return float(np.sqrt(max(squared, 0.0)))


@dataclass(frozen=True)
class Quality:
    """How well an outcome model predicts rewards on the slice it was checked on."""

    episodes: int
    auroc: float
    brier: float
    brier_baseline: float
    calibration_error: float
    r2: float

    @classmethod
    def measure(cls, pred: np.ndarray, reward: np.ndarray, low: float, high: float) -> Quality:
        """`pred` and `reward` on the reward's scale; [low, high]: the range scaled to [0, 1]."""
        span = (high - low) or 1.0
        p, r = (np.asarray(pred, float) - low) / span, (np.asarray(reward, float) - low) / span
        brier = float(np.mean((p - r) ** 2))
        baseline = float(np.var(r))
        return cls(
            len(r),
            auroc(p, r),
            brier,
            baseline,
            calibration_error(p, r),
            1.0 - brier / baseline if baseline > 0 else float("nan"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
