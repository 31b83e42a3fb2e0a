"""The judge hook with a tiny local model: the score is read from answer-token probabilities,
cached per (episode, judge version), and limited by a per-run budget."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from reward.judge import Judge, JudgeError
from reward.signals import Episode
from reward.spec import JudgeSpec, parse_spec
from reward.stage import run_rewards
from tests.support.factories import BASE_TS, interaction
from tests.support.factories import feedback as fb
from tests.support.stores import store
from tests.support.tiny_model import build_tiny_model

LATER = BASE_TS.replace(tzinfo=None) + timedelta(days=1)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("judge-model")))


def spec_with_judge(model: str, budget: int = 100):
    return parse_spec(
        f'name = "judged"\n[signals.accepted]\nweight = 0.5\n'
        f'[judge]\nmodel = "{model}"\nweight = 0.4\nbudget = {budget}\nbatch_size = 2\n'
    )


def test_score_is_p_yes_over_yes_plus_no_and_batching_does_not_change_it(tiny_model):
    judge = Judge(JudgeSpec(model=tiny_model, batch_size=3))
    eps = [
        Episode(request_id=str(i), ts=LATER, policy_version="1", text=t, prompt_text="add a and b")
        for i, t in enumerate(["return a + b", "sorry", "def add ( a , b ) : return a + b"])
    ]
    batched = judge.score(eps)
    assert all(0 < s < 1 for s in batched)
    # one at a time, no padding, by hand: softmax over the two answer logits
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    yes, no = tok.encode(" yes", add_special_tokens=False)[0], tok.encode(" no", add_special_tokens=False)[0]
    for ep, got in zip(eps, batched):
        ids = tok(judge.prompt(ep), return_tensors="pt")
        with torch.no_grad():
            logits = model(**ids).logits[0, -1]
        expected = torch.softmax(logits[[yes, no]], dim=-1)[0].item()
        assert got == pytest.approx(expected, abs=1e-5)
    assert judge.score(eps) == batched  # deterministic


def test_rewards_with_a_judge_are_cached_and_budgeted(engine, tiny_model, monkeypatch):
    store(engine, *[e for i in range(20, 23) for e in (interaction(i), fb(i, kind="accepted"))])
    spec = spec_with_judge(tiny_model, budget=2)
    calls = []
    real_score = Judge.score
    monkeypatch.setattr(Judge, "score", lambda self, eps: calls.append(len(eps)) or real_score(self, eps))
    first = run_rewards(engine, spec, now=LATER)
    assert (first.computed, first.judge_deferred, sum(calls)) == (2, 1, 2)
    second = run_rewards(engine, spec, now=LATER)
    assert (second.computed, second.judge_deferred, sum(calls)) == (1, 0, 3)
    # re-scoring every episode reads the cache: the model is not called again
    again = run_rewards(engine, spec, now=LATER, force=True)
    assert again.updated == 3 and sum(calls) == 3
    from pipeline.core.store.rewards import stored_reward

    row = stored_reward(engine, "ev-r-20", spec.version)
    assert set(row.components) == {"signal.accepted", "judge.score"}
    assert -0.4 < row.components["judge.score"] < 0.4


def test_missing_judge_model_is_a_clear_error(tmp_path):
    with pytest.raises(JudgeError, match=str(tmp_path / "nope")):
        Judge(JudgeSpec(model=str(tmp_path / "nope")))


def test_a_judge_with_a_chat_template_is_asked_in_a_user_turn(bpe_base):
    ep = Episode(request_id="1", ts=LATER, policy_version="1", text="return a + b", prompt_text="add a and b")
    chat = Judge(JudgeSpec(model=str(bpe_base), yes="yes", no="no", chat=True))
    asked = chat.prompt(ep)
    assert asked.startswith("<|im_start|>system\n") and "<|im_start|>user\nRequest:\nadd a and b" in asked
    assert asked.endswith("<|im_start|>assistant\n") and 0 < chat.score([ep])[0] < 1
    plain = Judge(JudgeSpec(model=str(bpe_base), yes="yes", no="no"))  # the default: as before
    assert plain.prompt(ep).startswith("Request:\nadd a and b") and plain.version != chat.version


def test_the_judge_options_added_later_leave_existing_versions_alone(tiny_model):
    """A spec written before [judge] chat/device existed keeps its version and its judge's
    cached scores (the hashes of the fields it had)."""
    import hashlib
    import json
    from pathlib import Path

    from reward.judge import judge_version

    spec = spec_with_judge(tiny_model)
    old_section = json.loads(spec.judge.model_dump_json(exclude={"chat", "device"}))
    config = (Path(tiny_model) / "config.json").read_bytes()
    weights = sorted((p.name, p.stat().st_size) for p in Path(tiny_model).glob("*.safetensors"))
    # what the judge section serialised to before the two fields existed
    written_before = spec.judge.model_dump_json(exclude={"chat", "device"})
    before = hashlib.sha256(written_before.encode() + config + json.dumps(weights).encode()).hexdigest()[:12]
    assert judge_version(spec.judge) == f"judge@{before}"
    content = spec.model_dump(mode="json")
    content["judge"] = old_section
    for entry in content["signals"].values():  # (an earlier later-field, left out the same way)
        entry.pop("half_life_s")
    assert content.pop("episode") is None  # (a later section, left out the same way when absent)
    assert (
        spec.version.split("@")[1]
        == hashlib.sha256(json.dumps(content, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]
    )
    assert spec_with_judge(tiny_model).judge.model_copy(update={"chat": True}) != spec.judge
