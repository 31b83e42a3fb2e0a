"""The agent task family (pipeline/demo/agent.py) and what measures it: the chat template and
the tool-call formats the base is warmed up on, and the online tool-format canary of a staged
rollout (deploy/rollout.py)."""

from __future__ import annotations

import json
import random

import pytest

from deploy import rollout
from pipeline.core.chat import parse_tool_calls
from pipeline.core.config import RolloutConfig
from pipeline.demo.agent import (
    AGENT_TEMPLATE,
    TOOLS,
    AgentTask,
    base_behaviour,
    broken_call,
    call_text,
    messages_after_call,
)


@pytest.fixture(scope="module")
def tokenizer():
    from train.tiny_tokenizers import char_tokenizer

    tok = char_tokenizer(tool_markers=True)
    tok.chat_template = AGENT_TEMPLATE
    return tok


def test_a_well_formed_call_parses_and_every_broken_one_is_flagged():
    good = parse_tool_calls(call_text(), TOOLS)
    assert good.valid and good.calls[0]["function"]["name"] == "read_selection"
    assert json.loads(good.calls[0]["function"]["arguments"]) == {}
    rng = random.Random(0)
    broken = {broken_call(rng) for _ in range(60)}
    assert len(broken) == 3  # unterminated, not JSON, arguments not an object
    for text in broken:
        calls = parse_tool_calls(text, TOOLS)
        assert calls.calls and not calls.valid, text


def test_the_base_tokenizer_writes_a_call_s_markers_as_one_token_each(tokenizer):
    """The agent base's char tokenizer has `<tool_call>` and `</tool_call>` as tokens (after the
    characters: the single-turn base's vocabulary is unchanged); text round-trips."""
    from train.tiny_tokenizers import char_tokenizer

    ids = tokenizer(call_text(), add_special_tokens=False).input_ids
    assert len(ids) == len(call_text()) - len("<tool_call>") - len("</tool_call>") + 2
    assert tokenizer.decode(ids) == call_text()
    assert ids[0] == len(char_tokenizer()) and ids[-1] == len(char_tokenizer()) + 1
    assert char_tokenizer().get_vocab() == {k: v for k, v in tokenizer.get_vocab().items() if v < len(char_tokenizer())}


def test_the_template_renders_the_conversation_until_a_tool_answers_then_its_result(tokenizer):
    task = AgentTask("7", "abcd")
    rendered = tokenizer.apply_chat_template(
        messages_after_call(task), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    # once the tool answered, its latest result only: the single-turn demo's prompt (see AGENT_TEMPLATE)
    assert rendered == "abcd>"
    conversation = [
        {"role": "user", "content": "reverse selection 7"},
        {"role": "assistant", "content": "done?"},
        {"role": "user", "content": "no"},
    ]
    assert (
        tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        == "U: reverse selection 7\nA: done?\nU: no\nA: "
    )
    first = tokenizer.apply_chat_template(
        messages_after_call(task)[:1], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert first == "U: reverse selection 7\nA: "
    # the warm-up's cached prompts are the renders of the whole conversation, whatever the ask's key
    from pipeline.demo.agent import _rendered, render

    assert _rendered(tokenizer, "", "abcd") == render(tokenizer, messages_after_call(task))
    assert _rendered(tokenizer, "7", None) == render(tokenizer, messages_after_call(task)[:1])


def test_the_base_is_warmed_up_on_both_steps_with_the_shares_the_docstring_names(tokenizer):
    rng = random.Random(0)
    kinds = {"call": 0, "broken": 0, "guess": 0, "reverse": 0, "copy": 0, "broken_after": 0}
    for _ in range(4000):
        prompt, answer = base_behaviour(rng, tokenizer)
        step2 = prompt.endswith(">")
        word = prompt[:-1] if step2 else None
        calls = parse_tool_calls(answer, TOOLS)
        if not step2:
            kinds["call" if calls.valid else "broken" if calls.calls else "guess"] += 1
        else:
            kinds["broken_after" if calls.calls else "reverse" if answer == word[::-1] else "copy"] += 1
    step1 = kinds["call"] + kinds["broken"] + kinds["guess"]
    assert 0.25 < kinds["call"] / step1 < 0.35 and 0.03 < kinds["broken"] / step1 < 0.07
    step2 = kinds["reverse"] + kinds["copy"] + kinds["broken_after"]
    # reversed up to 5 letters, never at 6 (a quarter of the words: copied, or a broken call 5 %)
    assert 0.71 < kinds["reverse"] / step2 < 0.79 and 0.004 < kinds["broken_after"] / step2 < 0.025


def test_the_online_tool_format_canary_refuses_a_canary_that_writes_broken_calls():
    cfg = RolloutConfig(share=0.5, min_requests=60, margin=0.05)
    # the rewards alone: a canary the sequential test promotes
    even = rollout.look(([0.5, -0.5] * 1000, [0.0] * 2000), ([0.6, -0.4] * 1000, [0.0] * 2000), cfg)
    assert even.verdict == "promote"
    hacked = rollout.decide(even, cfg, tool_calls=((300, 15), (300, 90)))
    assert not hacked.passed
    failing = [c for c in hacked.checks if not c.passed]
    assert [c.name for c in failing] == ["online.tool_format_error_rate"] and "30.0 % of 300" in failing[0].detail
    assert rollout.decide(even, cfg, tool_calls=((300, 15), (300, 18))).passed  # noise is not refused
    assert rollout.decide(even, cfg, tool_calls=((300, 0), (300, 0))).passed  # no tools at all
    # a champion with no broken call among few is not certain of its 0 % (a demo run's v1 was
    # refused at 6 of 130 against 0 of 90 by the plain Wald bound); a clear increase still is refused
    assert rollout.decide(even, cfg, tool_calls=((90, 0), (130, 6))).passed
    assert not rollout.decide(even, cfg, tool_calls=((90, 0), (130, 20))).passed
    off = RolloutConfig(share=0.5, min_requests=60, margin=0.05, max_tool_error_increase=None)
    assert rollout.decide(even, off, tool_calls=((300, 15), (300, 90))).passed


def test_each_demo_sizes_its_canary_for_its_own_traffic(tmp_path):
    """The agent demo's settings are the single-turn demo's with its own on top: a rollout size
    it does not set is inherited. The single-turn fleet settles ~12 requests a second a side, the
    agent fleet ~2 episodes: each demo's sequential test must be able to end undecided (at
    max_requests) before its max_wait, and its fixed-size equivalent must fit below that."""
    from deploy.sequential import Design, fixed_horizon_n
    from pipeline.core.config import duration_s
    from pipeline.demo.config import demo_settings

    single = demo_settings(tmp_path, tmp_path / "demo", False, "45s", 0, "t")["rollout"]
    agent = demo_settings(tmp_path, tmp_path / "demo-agent", False, "45s", 0, "t", task="agent")["rollout"]
    assert agent["max_wait"] == single["max_wait"] and agent["share"] == single["share"]  # inherited
    for settings, per_second, sd in ((single, 12, 0.64), (agent, 2, 0.8)):
        cfg = RolloutConfig(**settings)
        assert cfg.max_requests / per_second < duration_s(cfg.max_wait)
        assert fixed_horizon_n(sd, sd, Design.of(cfg)) < cfg.max_requests
