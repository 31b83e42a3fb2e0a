"""The gate reads the estimator `gate.estimator` names, records every one, and says when it
fell back: evaluate() with a runner whose policies answer right at known rates and an outcome
model that scores right answers 1 and others 0 (a pure unit test: no model runs)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from deploy.evaluate import EvalJob, evaluate
from deploy.gate import decide
from pipeline.core.config import GateConfig
from pipeline.core.types import LoggedEpisode
from train.inference import Generation

RIGHT = {None: 0.3, "cand": 0.5}  # the champion (base) and the candidate: true rewards 0.3 and 0.5


class Runner:
    names = {"cand"}

    def add(self, name: str, adapter: Any) -> None: ...

    def remove(self, name: str) -> None: ...

    def prompt_tokens(self, prompt: Any, tools: list[dict] | None = None) -> int:
        return 3

    def generate(
        self,
        name,
        prompts,
        max_new_tokens=64,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        batch_size=1,
        reuse=False,
        tools=None,
    ):
        draws = random.Random(f"{seed}-{name}-{len(prompts)}")
        if temperature == 0.0:
            return [Generation("wrong", [1], [-0.1], 1.0) for _ in prompts]
        return [Generation("right" if draws.random() < RIGHT[name] else "wrong", [1], [-0.1], 1.0) for _ in prompts]

    def compare(self, p, q, episodes, max_tokens=None):
        # the logged answers: both policies as likely as the behaviour on every one (the IS
        # estimates then say "no difference", whatever the truth)
        behaviour = [sum(e.behavior_logprobs) for e in episodes]
        return behaviour, behaviour, 0.01


class Outcome:
    def __init__(self, usable: bool = True, why: str = "AUROC 0.9 (min 0.6)") -> None:
        self.usable, self.why, self.scored = usable, why, 0

    def score(self, episodes):
        self.scored += len(episodes)
        return [1.0 if e.completion == "right" else 0.0 for e in episodes]


def held_out(n: int = 300) -> list[LoggedEpisode]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        right = rng.random() < 0.3
        out.append(
            LoggedEpisode(
                f"r{i}",
                f"task {i % 150}>",
                "right" if right else "wrong",
                [1],
                [-1.0],
                temperature=1.0,
                reward=float(right),
            )
        )
    return out


def gate(**kw) -> GateConfig:
    return GateConfig(min_ess=3, bootstrap=500, fresh_prompts=150, fresh_samples=4, bounds={}, **kw)


def run(cfg: GateConfig, outcome):
    ev = evaluate(EvalJob(Runner(), "cand", None, held_out(), cfg, generate_prompts=10, seed=3, outcome=outcome))
    return ev, decide(ev.candidate, ev.champion, ev.comparison, cfg, first=True)


def test_the_direct_estimate_decides_and_every_estimate_is_recorded():
    ev, decision = run(gate(estimator="direct"), Outcome())
    c = ev.comparison
    assert c.estimator == "direct" and c.note == ""
    assert c.improvement.value == pytest.approx(0.2, abs=0.05) and c.improvement.low > 0
    assert set(c.estimates) == {"importance", "direct", "doubly_robust"}
    assert c.estimates["importance"]["improvement"]["value"] == pytest.approx(0.0)  # blind to the difference
    assert c.estimates["doubly_robust"]["improvement"]["value"] == pytest.approx(0.2, abs=0.06)
    assert c.estimates["direct"]["n"] == 150
    assert decision.passed, decision.reasons
    ess = next(ch for ch in decision.checks if ch.name == "ess")
    assert not ess.applicable and "direct does" in ess.detail
    improvement = next(ch for ch in decision.checks if ch.name == "improvement")
    assert improvement.detail.endswith("; direct)")


def test_a_weak_outcome_model_makes_the_gate_fall_back_and_say_so():
    weak = Outcome(usable=False, why="too weak: AUROC 0.52 (min 0.6)")
    ev, decision = run(gate(estimator="direct"), weak)
    assert weak.scored == 0  # not used at all
    c = ev.comparison
    assert c.estimator == "importance"
    assert c.estimates["direct"]["why_not"] == "the outcome model too weak: AUROC 0.52 (min 0.6)"
    check = next(ch for ch in decision.checks if ch.name == "estimator")
    assert check.passed and check.detail.startswith("fell back to importance sampling: direct could not be computed")
    assert not decision.passed  # importance sampling sees no improvement: refused by its bound
    assert "improvement" in {ch.name for ch in decision.checks if not ch.passed}


def test_no_outcome_model_and_fallback_refuse_fails_the_gate_with_the_reason():
    ev, decision = run(gate(estimator="doubly_robust", fallback="refuse"), None)
    check = next(ch for ch in decision.checks if ch.name == "estimator")
    assert not check.passed and "is missing" in check.detail and "gate.fallback = 'refuse'" in check.detail
    assert not decision.passed


def test_importance_decides_when_named_and_ignores_the_model_for_the_decision():
    ev, _ = run(gate(estimator="importance"), Outcome())
    assert ev.comparison.estimator == "importance" and ev.comparison.note == ""
    assert ev.comparison.estimates["direct"]["improvement"]["value"] == pytest.approx(0.2, abs=0.05)
