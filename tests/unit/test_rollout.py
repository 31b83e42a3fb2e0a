"""The staged rollout's pure part: the online comparison that promotes, withdraws or waits (and
says why)."""

from __future__ import annotations

import random

from deploy import rollout
from pipeline.core.config import RolloutConfig


def _units(values: list[float]) -> rollout.Units:
    return values, [0.0] * len(values)


def test_the_online_test_promotes_withdraws_or_waits_and_says_why():
    cfg = RolloutConfig(share=0.5, min_requests=100, margin=0.05, effect=0.05, confidence=0.95)
    rng = random.Random(0)
    champion = _units([0.4 if rng.random() < 0.5 else -0.4 for _ in range(400)])
    better = _units([0.4 if rng.random() < 0.7 else -0.4 for _ in range(400)])
    worse = _units([0.4 if rng.random() < 0.3 else -0.4 for _ in range(400)])
    promoted = rollout.look(champion, better, cfg)
    assert promoted.verdict == "promote" and rollout.decide(promoted, cfg).passed
    withdrawn = rollout.look(champion, worse, cfg)
    decision = rollout.decide(withdrawn, cfg)
    assert not decision.passed and "futility boundary" in decision.reasons[0]
    # the same canary as the champion on few requests: neither boundary yet -- the test waits
    # (a fixed-size test would have had to decide on these)
    tie = rollout.look(_units(champion[0][:100]), _units(champion[0][:100]), cfg)
    assert tie.verdict == "continue" and tie.expected_more[1] > 0
    assert rollout.look(champion, _units(better[0][:99]), cfg).verdict == "continue"  # before the first look
    assert rollout.look(None, better, cfg).n_champion == 0
    undecided = rollout.look(
        _units(champion[0][:100]), _units(champion[0][:100]), cfg.model_copy(update={"max_requests": 100})
    )
    assert undecided.verdict == "truncated" and "neither boundary" in rollout.decide(undecided, cfg).reasons[0]
    assert "max_wait" in rollout.too_little_traffic(rollout.look(None, _units([0.1] * 3), cfg), cfg).reasons[0]
