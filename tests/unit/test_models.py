"""Models: tiny ones from a config, local loading only, clear errors for bad directories."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

from pipeline.cli import cli
from train.models import ModelError, init_tiny, load_policy, render_prompt


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_init_tiny_is_seeded_loadable_and_generates(tmp_path, arch):
    a = load_policy(init_tiny(tmp_path / "a", arch=arch, seed=3))
    b = load_policy(init_tiny(tmp_path / "b", arch=arch, seed=3))
    assert a.model.config.model_type == arch
    for (name, pa), pb in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(pa, pb), name
    text = "reverse: a b\nc"
    ids = a.tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text) and a.tokenizer.decode(ids) == text  # one token per character
    prompt = render_prompt(a.tokenizer, [{"role": "user", "content": "abc"}])
    assert prompt == "user: abc\nassistant: "
    enc = a.tokenizer(prompt, return_tensors="pt")
    out = a.model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=a.tokenizer.pad_token_id)
    assert out.shape[1] == enc.input_ids.shape[1] + 4


def test_missing_or_corrupt_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match=f"no model at {tmp_path / 'nope'}"):
        load_policy(tmp_path / "nope")
    broken = init_tiny(tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match=str(broken)):
        load_policy(broken)


def test_model_commands(tmp_path):
    out = tmp_path / "m"
    made = CliRunner().invoke(cli, ["model", "init-tiny", "--out", str(out), "--arch", "qwen2"])
    assert made.exit_code == 0, made.output
    shown = CliRunner().invoke(cli, ["model", "show", str(out)])
    assert shown.exit_code == 0 and "qwen2" in shown.output and "parameters" in shown.output, shown.output
    missing = CliRunner().invoke(cli, ["model", "show", str(tmp_path / "x")])
    assert missing.exit_code != 0 and "rtrl model init-tiny" in missing.output


CHAT = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "where is the config?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "config"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "found: rtrl.toml"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "find files",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]


def test_a_bpe_model_loads_like_a_downloaded_one_and_renders_every_turn(bpe_base):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = load_policy(bpe_base)
    tok = policy.tokenizer
    assert len(tok) == policy.model.config.vocab_size == 32_768 and tok.eos_token == "<|im_end|>"
    # the files a downloaded model has, loaded by the Auto classes
    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "model.safetensors"} <= {
        p.name for p in bpe_base.iterdir()
    }
    assert AutoModelForCausalLM.from_pretrained(bpe_base).config.model_type == "qwen2"
    auto = AutoTokenizer.from_pretrained(bpe_base)
    text = render_prompt(tok, CHAT)
    assert text == render_prompt(auto, CHAT)
    assert text == (
        "<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nwhere is the config?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "search", "arguments": {"q": "config"}}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nfound: rtrl.toml\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = tok.apply_chat_template(CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "search"' in with_tools.split("<tools>\n")[1] and with_tools.endswith("<|im_start|>assistant\n")
    # subword: far fewer tokens than characters; ids decode back to the text; markers are one token
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) < len(text) / 2 and tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(tok("<tool_call>", add_special_tokens=False).input_ids) == ["<tool_call>"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 5


def test_init_tiny_bpe_from_the_command_line_is_seeded(tmp_path):
    runner = CliRunner()
    for name in ("a", "b"):
        result = runner.invoke(
            cli,
            [
                "model",
                "init-tiny",
                "--out",
                str(tmp_path / name),
                "--tokenizer",
                "bpe",
                "--vocab",
                "2000",
                "--arch",
                "llama",
            ],
        )
        assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert load_policy(tmp_path / "a").model.config.vocab_size == 2000
    bad = runner.invoke(
        cli, ["model", "init-tiny", "--out", str(tmp_path / "c"), "--tokenizer", "bpe", "--vocab", "10"]
    )
    assert bad.exit_code != 0 and "--vocab must be between" in bad.output
