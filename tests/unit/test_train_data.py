"""Episodes to tokens: only assistant tokens carry loss (checked token by token), behaviour
log-probs align with the served tokens or are dropped and counted."""

from __future__ import annotations

import pytest

from train.data import DataStats, Skip, tokenize_episode
from train.models import init_tiny, load_policy


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_policy(init_tiny(tmp_path_factory.mktemp("tiny"))).tokenizer


def test_a_trajectory_trains_only_on_assistant_tokens(tokenizer):
    traj = [
        {"role": "assistant", "content": "ls", "tool_calls": [{"name": "sh", "arguments": "{}"}]},
        {"role": "tool", "content": "a.py b.py"},
        {"role": "user", "content": "and?"},
        {"role": "assistant", "content": "done"},
    ]
    ep = tokenize_episode(tokenizer, "r", [{"role": "user", "content": "list"}], traj)
    tokens = [tokenizer.decode([t]) for t in ep.input_ids]
    trained = "".join(t for t, m in zip(tokens, ep.loss_mask) if m)
    context = "".join(t for t, m in zip(tokens, ep.loss_mask) if not m)
    assert trained == 'ls[{"name": "sh", "arguments": "{}"}]done'  # as the chat template writes it
    assert context == "user: list\nassistant: \ntool: a.py b.py\nuser: and?\nassistant: "
    # token by token: every character of the tool result and the user turn is masked
    joined = "".join(tokens)
    start = joined.index("a.py b.py")
    assert ep.loss_mask[start : start + len("a.py b.py")] == [0] * len("a.py b.py")
    assert ep.behavior is None and ep.behavior_note == "missing"


def test_behaviour_logprobs_align_with_served_tokens_or_are_dropped_and_counted(tokenizer):
    stats = DataStats()
    served = tokenizer("cba", add_special_tokens=False).input_ids
    ok = tokenize_episode(tokenizer, "a", "reverse abc: ", "cba", served, [-0.1, -0.2, -0.3], stats)
    assert ok.behavior_note == "served_ids"
    assert [b for b, m in zip(ok.behavior, ok.loss_mask) if m] == [-0.1, -0.2, -0.3]
    assert [b for b, m in zip(ok.behavior, ok.loss_mask) if not m] == [0.0] * (len(ok.input_ids) - 3)
    bad = tokenize_episode(tokenizer, "b", "reverse abc: ", "cba", served, [-0.1, -0.2], stats)
    assert bad.behavior is None and bad.behavior_note == "misaligned"
    retok = tokenize_episode(tokenizer, "c", "p", "xyz", None, [-1.0, -1.0, -1.0], stats)
    assert retok.behavior_note == "retokenized" and retok.behavior is not None
    assert stats.behavior == {"served_ids": 1, "misaligned": 1, "retokenized": 1} and stats.episodes == 3


def test_empty_completion_and_no_assistant_turn_are_counted_skips(tokenizer):
    stats = DataStats()
    assert tokenize_episode(tokenizer, "e", "p", "", stats=stats) is Skip.EMPTY_COMPLETION
    assert (
        tokenize_episode(tokenizer, "t", "p", [{"role": "tool", "content": "x"}], stats=stats)
        is Skip.NO_ASSISTANT_TOKENS
    )
    assert stats.skipped == {"empty_completion": 1, "no_assistant_tokens": 1} and stats.episodes == 0


def test_a_trajectory_is_rendered_by_the_chat_template_turn_by_turn(bpe_base):
    """On a ChatML model: the prompt is what serving rendered, each assistant turn (its tool
    call and end-of-turn token included) carries loss, tool results and headers are context."""
    from train.models import render_prompt

    tok = load_policy(bpe_base).tokenizer
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "where is the config?"}]
    traj = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "config"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "found: rtrl.toml"},
        {"role": "assistant", "content": "It is rtrl.toml."},
    ]
    ep = tokenize_episode(tok, "r", prompt, traj)
    served_prompt = tok(render_prompt(tok, prompt), add_special_tokens=False).input_ids
    assert ep.input_ids[: len(served_prompt)] == served_prompt and not any(ep.loss_mask[: len(served_prompt)])
    spans, current = [], []
    for t, m in zip(ep.input_ids, ep.loss_mask):
        if m:
            current.append(t)
        elif current:
            spans.append(tok.decode(current))
            current = []
    spans += [tok.decode(current)] if current else []
    assert spans == [
        '<tool_call>\n{"name": "search", "arguments": {"q": "config"}}\n</tool_call><|im_end|>',
        "It is rtrl.toml.<|im_end|>",
    ]
    whole = tok.apply_chat_template(prompt + traj, tokenize=False)
    assert tok.decode(ep.input_ids) + "\n" == whole  # nothing lost or added but the template's last newline


def test_a_truncated_stream_and_the_tools_offered_reach_the_selection_s_tokenization(bpe_base):
    """A stream the client left (its event marked truncated) is skipped and counted; an answer
    to a prompt that offered tools is tokenized with the tools rendered, as serving rendered it."""
    from types import SimpleNamespace

    import orjson

    from pipeline.core.chat import render_prompt
    from pipeline.core.config import TrainConfig
    from pipeline.core.store.training import Selection
    from train.run import TrainReport
    from train.selection import tokenize_selection

    tok = load_policy(bpe_base).tokenizer
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    prompt = [{"role": "user", "content": "the word under k1, reversed"}]
    body = {"prompt": prompt, "completion": "desserts", "tools": tools}
    rows = [
        SimpleNamespace(request_id=f"r{i}", body=orjson.dumps({**body, "truncated": i == 1}), reward=1.0)
        for i in range(2)
    ]
    report = TrainReport(None, {}, 0, 0, DataStats())
    episodes, _, _ = tokenize_selection(tok, Selection(rows, 0, 0), TrainConfig(max_seq_len=4096), report)
    assert report.data.skipped == {Skip.TRUNCATED.value: 1} and len(episodes) == 1
    with_tools = tok(render_prompt(tok, prompt, tools), add_special_tokens=False).input_ids
    assert episodes[0].input_ids[: len(with_tools)] == with_tools and "lookup" in render_prompt(tok, prompt, tools)


def test_episodes_of_one_task_are_one_group_whatever_came_after_the_task():
    """Group-relative advantages compare answers to the same task: an agent's later call (more
    turns after the first user message) and a call under another system prompt are the task's."""
    from pipeline.core.types import task_key

    task = {"role": "user", "content": "rename foo.py"}
    first = [{"role": "system", "content": "terse"}, task]
    later = [
        {"role": "system", "content": "verbose"},
        task,
        {"role": "assistant", "content": "looking"},
        {"role": "tool", "content": "foo.py exists"},
    ]
    assert task_key(first) == task_key(later) != task_key([{"role": "user", "content": "rename bar.py"}])
    assert task_key("reverse: abc") != task_key("reverse: abd")  # a text prompt is its own task
