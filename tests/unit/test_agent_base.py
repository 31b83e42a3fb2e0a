"""The agent base's calibration (pipeline/demo/agent_base.py): measured, its share of calls set
toward the target by how far off it is, its format mended where it breaks too many calls, and
left alone once inside. The measures and the training are stand-ins here (the demo runs the real
ones: docs/benchmarks.md), but for set_call_share, whose loop is run on a tiny model."""

from __future__ import annotations

import pytest

from pipeline.demo import agent_base


@pytest.fixture
def calls(monkeypatch, tmp_path):
    """Measures to report, in order (success, broken share of first calls, share of calls), and
    the shares of calls each round set."""
    set_to: list[float] = []
    measures: list[tuple[float, float, float]] = []
    current: list[float] = []

    def estimate_base(out, rng, n):
        success, broken, share = measures.pop(0)
        current[:] = [share]
        return success, broken

    monkeypatch.setattr(agent_base, "estimate_base", estimate_base)
    monkeypatch.setattr(agent_base, "call_share", lambda out: current[0])
    monkeypatch.setattr(agent_base, "set_call_share", lambda out, target, seed: set_to.append(target))
    return measures, set_to, tmp_path


def test_a_base_inside_the_target_is_left_as_it_is(calls):
    measures, set_to, out = calls
    measures += [(0.12, 0.05, 0.2)]
    assert agent_base.calibrate(out, 0, say=lambda _: None) == [
        {"success": 0.12, "broken_calls": 0.05, "call_share": 0.2}
    ]
    assert set_to == []


def test_a_base_too_good_gets_the_share_its_successes_per_call_say(calls):
    measures, set_to, out = calls
    measures += [(0.40, 0.10, 0.6), (0.10, 0.08, 0.19)]
    said: list[str] = []
    rounds = agent_base.calibrate(out, 0, say=said.append)
    # 0.40 successes from 0.6 x 0.9 valid calls: 0.74 a call; 0.12 (the middle) needs 0.18 of calls,
    # 0.9 of them valid
    per_call = 0.40 / (0.6 * 0.9)
    assert set_to == [pytest.approx(0.12 / per_call / 0.9)]
    assert [r["success"] for r in rounds] == [0.40, 0.10] and "next_call_share" not in rounds[-1]
    assert "40 % -> 10 %" in said[0] and "broken calls 8 %" in said[0]


def test_a_base_breaking_its_calls_is_credited_for_the_calls_it_will_write_well(calls):
    measures, set_to, out = calls
    measures += [(0.05, 0.75, 0.3), (0.12, 0.08, 0.22)]
    agent_base.calibrate(out, 0, say=lambda _: None)
    per_call = 0.05 / (0.3 * 0.25)  # its valid calls' successes: 0.67 a call
    assert set_to == [pytest.approx(0.12 / per_call / (1 - agent_base.FORMAT_MAX))]


def test_a_base_in_the_target_with_its_format_broken_keeps_its_share_while_the_format_mends(calls):
    measures, set_to, out = calls
    measures += [(0.12, 0.5, 0.4), (0.2, 0.05, 0.4), (0.11, 0.05, 0.25)]
    agent_base.calibrate(out, 0, say=lambda _: None)
    assert set_to[0] == 0.4 and set_to[1] < 0.4


def test_the_rounds_are_bounded_and_the_last_measure_is_reported(calls):
    measures, set_to, out = calls
    measures += [(0.01, 0.05, 0.5)] * (agent_base.CALIBRATION_ROUNDS + 1)
    rounds = agent_base.calibrate(out, 0, say=lambda _: None)
    assert len(rounds) == agent_base.CALIBRATION_ROUNDS + 1 and "next_call_share" not in rounds[-1]
    assert set_to == [0.8] * agent_base.CALIBRATION_ROUNDS  # capped


def test_set_call_share_trains_a_model_to_the_share_asked_for(tmp_path, monkeypatch):
    from pipeline.demo.agent import AGENT_TEMPLATE
    from train.models import init_tiny

    init_tiny(tmp_path, arch="llama", hidden=32, layers=1, heads=2, seed=0, tool_markers=True)
    (tmp_path / "chat_template.jinja").write_text(AGENT_TEMPLATE)
    monkeypatch.setattr(agent_base, "SHARE_LR", 2e-3)  # a fresh model: far from any share
    before = agent_base.call_share(tmp_path)
    steps = agent_base.set_call_share(tmp_path, 0.05, seed=0)
    after = agent_base.call_share(tmp_path)
    assert before < 0.02 and abs(after - 0.05) <= agent_base.SHARE_TOLERANCE, (before, after, steps)
