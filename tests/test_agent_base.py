"""The agent base's calibration (pipeline/demo/agent_base.py): measured, warmed up toward the
target with the share of calls scaled by how far off it is, and left alone once inside. The
measure and the warm-up are stand-ins here (the demo runs the real ones: docs/benchmarks.md);
what is under test is the loop around them."""

from __future__ import annotations

import pytest

from pipeline.demo import agent_base
from pipeline.demo.agent import P_CALL


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """Successes to report, in order, and the shares of calls each warm-up was given."""
    shares: list[float] = []
    measures: list[float] = []
    monkeypatch.setattr(agent_base, "estimate_success", lambda out, rng, n: measures.pop(0))

    def warm_up(out, sample, steps, batch, lr, seed):
        shares.append(sample.__defaults__[0])  # the share bound to the sampler (p=...)
        assert steps == agent_base.CALIBRATION_STEPS and lr == agent_base.CALIBRATION_LR
    monkeypatch.setattr("train.warmup.warm_up", warm_up)
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", lambda out: object())
    return measures, shares, tmp_path


def test_a_base_inside_the_target_is_left_as_it_is(calls):
    measures, shares, out = calls
    measures += [0.12]
    assert agent_base.calibrate(out, 0, 64, 3e-3, say=lambda _: None) == [{"success": 0.12}]
    assert shares == []


def test_a_base_too_good_is_taught_fewer_calls_at_most_halving_then_bisecting_until_inside(calls):
    measures, shares, out = calls
    measures += [0.34, 0.06, 0.15]
    said: list[str] = []
    rounds = agent_base.calibrate(out, 0, 64, 3e-3, say=said.append)
    assert [r["success"] for r in rounds] == [0.34, 0.06, 0.15]
    # 0.3 * 0.12 / 0.34 -> halved at most; then between the two shares tried (bisection)
    assert shares == [pytest.approx(P_CALL / 2), pytest.approx((P_CALL / 2 * P_CALL) ** 0.5)]
    assert "34 % -> 6 % -> 15 %" in said[0]


def test_the_rounds_are_bounded_and_the_last_measure_is_reported(calls):
    measures, shares, out = calls
    measures += [0.01] * (agent_base.CALIBRATION_ROUNDS + 1)
    rounds = agent_base.calibrate(out, 0, 64, 3e-3, say=lambda _: None)
    assert len(rounds) == agent_base.CALIBRATION_ROUNDS + 1 and "next_call_share" not in rounds[-1]
    assert shares == [pytest.approx(0.6)] * agent_base.CALIBRATION_ROUNDS  # doubled once, then capped
