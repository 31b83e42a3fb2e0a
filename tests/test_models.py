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
