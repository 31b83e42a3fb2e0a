"""The gate's tool-format canary samples each policy's calls as serving would (at the serving
temperature, with the tools the prompt was served with): a policy that learned to break its calls
where it expects to fail keeps its greedy calls well formed (the naive agent demo's promoted
candidates served 14 % broken calls against the base's 4 %, and wrote none greedily)."""

from __future__ import annotations

import random
from typing import Any

from deploy.evaluate import EvalJob, broken_call, evaluate
from deploy.gate import decide
from pipeline.core.config import GateConfig
from pipeline.core.types import LoggedEpisode
from train.inference import Generation

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
GOOD = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
BROKEN = '<tool_call>\n{"name": "lookup", "arguments": "k1"}\n</tool_call>'  # arguments no object
UNOFFERED = '<tool_call>\n{"name": "lookupp", "arguments": {"key": "k1"}}\n</tool_call>'


class Runner:
    """Greedy: always a well-formed call. Sampled: the candidate breaks `cand_rate` of its calls,
    the champion `champ_rate`, drawn from `seed` (the same draws for both); what it was asked is
    recorded."""

    names = {"cand"}

    def __init__(self, champ_rate: float, cand_rate: float, after_result_only: bool = False) -> None:
        self.rates, self.asked, self.after_result_only = {None: champ_rate, "cand": cand_rate}, [], after_result_only

    def add(self, name: str, adapter: Any) -> None: ...

    def remove(self, name: str) -> None: ...

    def prompt_tokens(self, prompt: Any, tools: list[dict] | None = None) -> int:
        return 4

    def generate(
        self, name, prompts, max_new_tokens=64, temperature=0.0, seed=None, batch_size=1, reuse=False, tools=None
    ):
        self.asked.append((name, len(prompts), temperature, seed, tools))
        if temperature == 0.0:
            return [Generation(GOOD, [1], [-0.1], 1.0) for _ in prompts]
        draws = random.Random(seed)
        out = []
        for p in prompts:
            after = p[-1]["role"] == "tool"
            rate = self.rates[name] if after or not self.after_result_only else self.rates[None]
            out.append(Generation(BROKEN if draws.random() < rate else GOOD, [1], [-0.1], 1.0))
        return out

    def compare(self, p, q, episodes, max_tokens=None):
        behaviour = [sum(e.behavior_logprobs) for e in episodes]
        return behaviour, [b + 0.1 * (e.reward > 0) for b, e in zip(behaviour, episodes)], 0.01


def held_out(n: int = 200) -> list[LoggedEpisode]:
    """First calls, and every fourth one a call after the tool's result."""
    first = [{"role": "user", "content": "reverse the selection"}]
    after = first + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "lookup", "arguments": '{"key": "k1"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "abc"},
    ]
    return [
        LoggedEpisode(
            f"r{i}", after if i % 4 == 0 else first, GOOD, None, [-1.0, -1.0], 0.8, float(i % 2), tools=[LOOKUP]
        )
        for i in range(n)
    ]


def test_a_candidate_that_samples_more_broken_calls_is_refused_though_its_greedy_calls_are_well_formed():
    cfg = GateConfig(min_ess=1, max_kl=10.0, tool_samples=8)
    runner = Runner(champ_rate=0.04, cand_rate=0.14)
    evaluation = evaluate(EvalJob(runner, "cand", None, held_out(), cfg, generate_prompts=40, seed=5))
    cand, champ = evaluation.candidate.metrics, evaluation.champion.metrics
    assert cand["greedy_tool_format_error_rate"] == champ["greedy_tool_format_error_rate"] == 0.0
    assert champ["tool_format_error_rate"] < 0.08 < 0.1 < cand["tool_format_error_rate"]
    sampled = [a for a in runner.asked if a[2] != 0.0]
    # each kind of prompt (150 first calls, 50 after a result) up to tool_prompts = 64, 8 samples each
    assert [(a[1], a[2], a[3], a[4]) for a in sampled] == [(512, 0.8, 5, [LOOKUP]), (400, 0.8, 5, [LOOKUP])] * 2
    assert all(a[4] == [LOOKUP] for a in runner.asked)  # greedy answers too see the tools they were served with
    decision = decide(evaluation.candidate, evaluation.champion, evaluation.comparison, cfg)
    failing = [c for c in decision.checks if not c.passed]
    assert {c.name for c in failing} == {"bound:tool_format_error_rate", "bound:tool_format_error_rate_after_result"}
    assert any("increase" in c.detail for c in failing)

    # broken only after a tool's result (where the naive demo's policy breaks its calls: on the
    # words it cannot reverse): a quarter of the calls, which the first calls' mass would hide
    hidden = evaluate(
        EvalJob(Runner(0.04, 0.14, after_result_only=True), "cand", None, held_out(), cfg, generate_prompts=40, seed=5)
    )
    failing = [c for c in decide(hidden.candidate, hidden.champion, hidden.comparison, cfg).checks if not c.passed]
    assert {c.name for c in failing} == {"bound:tool_format_error_rate_after_result"}

    same = evaluate(EvalJob(Runner(0.04, 0.04), "cand", None, held_out(), cfg, generate_prompts=40, seed=5))
    assert same.candidate.metrics["tool_format_error_rate"] == same.champion.metrics["tool_format_error_rate"]
    assert decide(same.candidate, same.champion, same.comparison, cfg).passed


def test_prompts_without_tools_sample_nothing_and_break_nothing():
    runner = Runner(0.5, 0.5)
    plain = [LoggedEpisode(f"r{i}", "abc>", "cba", None, [-1.0], 1.0, 1.0) for i in range(20)]
    evaluation = evaluate(EvalJob(runner, "cand", None, plain, GateConfig(min_ess=1), generate_prompts=10))
    assert evaluation.candidate.metrics["tool_format_error_rate"] == 0.0
    assert all(a[2] == 0.0 or a[1] == 0 for a in runner.asked)


def test_a_call_is_broken_as_serving_flags_it():
    assert not broken_call(GOOD, [LOOKUP]) and not broken_call("cba", [LOOKUP])
    assert broken_call(BROKEN, [LOOKUP]) and broken_call(UNOFFERED, [LOOKUP])
    assert not broken_call(UNOFFERED)  # without the tools offered, any named call with object arguments
    assert broken_call('<tool_call>\n{"name": "lookup"', [LOOKUP])  # unterminated
