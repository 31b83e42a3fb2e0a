"""train/calibration.py against answers known in closed form."""

import numpy as np
import pytest

from train.calibration import Isotonic, Quality, auroc, calibration_error


def test_isotonic_is_the_monotone_least_squares_fit():
    # a violation pooled: (1, 3) then 2 -> the mean of 3 and 2 on both of their knots
    iso = Isotonic.fit(np.array([0.0, 1.0, 2.0]), np.array([1.0, 3.0, 2.0]))
    assert iso(np.array([0.0, 1.0, 2.0])) == pytest.approx([1.0, 2.5, 2.5])
    assert iso(np.array([-5.0, 9.0])) == pytest.approx([1.0, 2.5])  # held at the ends


def test_isotonic_recovers_a_known_probability_curve():
    rng = np.random.default_rng(0)
    score = rng.random(20_000)
    outcome = rng.random(20_000) < score**2  # P(1 | s) = s^2
    iso = Isotonic.fit(score, outcome.astype(float))
    grid = np.linspace(0.1, 0.9, 9)
    err = np.abs(iso(grid) - grid**2)  # a step function of noisy blocks: close on average
    assert err.mean() < 0.02 and err.max() < 0.08
    assert np.all(np.diff(iso(np.linspace(0, 1, 101))) >= 0)


def test_auroc_counts_concordant_pairs_and_ties_half():
    assert auroc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([0, 0, 1, 1])) == pytest.approx(0.75)
    assert auroc(np.array([0.5, 0.5]), np.array([0, 1])) == pytest.approx(0.5)
    # graded: every pair of different rewards, (0 < .5 < 1): 3 pairs, one of them discordant
    assert auroc(np.array([0.0, 0.9, 0.5]), np.array([0.0, 0.5, 1.0])) == pytest.approx(2 / 3)
    assert np.isnan(auroc(np.array([0.1, 0.2]), np.array([1.0, 1.0])))


def test_auroc_matches_the_brute_force_count():
    rng = np.random.default_rng(1)
    pred, target = rng.integers(0, 5, 300).astype(float), rng.integers(0, 4, 300).astype(float)
    i, j = np.meshgrid(range(300), range(300), indexing="ij")
    above = target[i] > target[j]
    brute = ((pred[i] > pred[j]) + 0.5 * (pred[i] == pred[j]))[above].sum() / above.sum()
    assert auroc(pred, target) == pytest.approx(brute)


def test_calibration_error_and_quality():
    rng = np.random.default_rng(2)
    p = rng.random(50_000)
    y = (rng.random(50_000) < p).astype(float)
    assert calibration_error(p, y) < 0.01  # calibrated by construction
    assert calibration_error(np.clip(p + 0.2, 0, 1), y) > 0.15  # shifted up by 0.2 (clipped)
    q = Quality.measure(p, y, 0.0, 1.0)
    assert q.brier == pytest.approx(np.mean((p - y) ** 2))
    assert q.brier_baseline == pytest.approx(np.var(y))
    assert q.r2 == pytest.approx(1 / 3, abs=0.02)  # E[p(1-p)] = 1/6 of var 1/4 left: r2 = 1/3
    assert q.auroc == pytest.approx(5 / 6, abs=0.01)  # for p ~ U(0, 1): the integral of 2a 2(1 - b) over a > b


def _graded(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Predictions calibrated by construction (E[r | pred] = pred) on rewards graded in [0, 1]:
    accepted (0.8 plus up to 0.2) or not (up to 0.2, half the time), most answers unaccepted."""
    accept = np.clip(rng.beta(0.5, 1.2, n), 0.01, 0.99)
    reward = (rng.random(n) < accept) * 0.8 + rng.random(n) * 0.2 * (rng.random(n) < 0.5)
    return accept * 0.8 + 0.05, reward


def test_calibration_error_does_not_count_a_small_slices_noise():
    # A check slice of ~160 episodes (a young store's): the plain binned error reads each bin's
    # sampling noise as miscalibration; the debiased one measures the systematic part.
    rng = np.random.default_rng(3)

    def plain(pred, target):
        order = np.argsort(pred, kind="stable")
        return sum(len(c) / len(order) * abs(pred[c].mean() - target[c].mean()) for c in np.array_split(order, 10))

    runs = [_graded(rng, 163) for _ in range(300)]
    assert np.mean([plain(p, r) for p, r in runs]) > 0.05  # calibrated, yet over the default limit
    debiased = np.array([calibration_error(p, r) for p, r in runs])
    assert debiased.mean() < 0.03 and (debiased <= 0.05).mean() > 0.7
    for shift in (0.05, 0.1):  # a real error is still seen, at its size
        shifted = [calibration_error(np.clip(p + shift, 0, 1), r) for p, r in runs]
        assert np.mean(shifted) == pytest.approx(shift, abs=0.015)
    assert np.isnan(calibration_error(np.array([0.5]), np.array([1.0])))


def test_a_calibrated_model_on_a_small_check_slice_is_judged_usable():
    from pipeline.core.config import OutcomeConfig
    from train.outcome import judge

    rng = np.random.default_rng(4)
    usable = [judge(Quality.measure(*_graded(rng, 163), 0.0, 1.0), OutcomeConfig())[0] for _ in range(200)]
    assert np.mean(usable) > 0.7
    pred, reward = _graded(rng, 163)
    ok, why = judge(Quality.measure(np.clip(pred + 0.15, 0, 1), reward, 0.0, 1.0), OutcomeConfig())
    assert not ok and why.startswith("too poorly calibrated")
