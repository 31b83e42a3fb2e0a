"""The training loop on a real (tiny) model: it learns from logged off-policy episodes, with and
without behaviour log-probs; checkpoints resume bit-for-bit; masks line up with the targets."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file

from tests.support import reverse_task as task
from tests.support.training import CFG, tokenized
from train.batches import collate, mismatched_pairs, pack
from train.loop import train_policy
from train.lora import attach_adapter, load_adapter
from train.models import ModelError, load_policy
from train.tracking import MemoryTracker


@pytest.fixture(scope="session")
def base_model(reverse_base):
    return reverse_base


@pytest.fixture(scope="session")
def logged(base_model):
    """Episodes sampled from the base policy, as serving logged them (4 samples per prompt)."""
    policy = load_policy(base_model, device="cpu")
    train_prompts, held_out = task.split()
    return task.sample_episodes(policy.model, policy.tokenizer, train_prompts, per_prompt=4, seed=1), held_out


def train(base_model, episodes, cfg=CFG, drop_behavior_every=0, **kw):
    policy = load_policy(base_model, device="cpu")
    torch.manual_seed(cfg.seed)
    model = attach_adapter(policy.model, cfg)
    eps = tokenized(policy.tokenizer, episodes, drop_behavior_every)
    tracker = MemoryTracker()
    result = train_policy(
        model,
        eps,
        [e["reward"] for e in episodes],
        [e["group"] for e in episodes],
        cfg,
        tracker,
        policy.tokenizer.pad_token_id,
        **kw,
    )
    return model, policy.tokenizer, result, tracker


@pytest.mark.parametrize("drop_behavior_every", [0, 2], ids=["all-behaviour-logprobs", "half-missing"])
def test_it_learns_to_reverse_from_logged_episodes(base_model, logged, drop_behavior_every):
    episodes, held_out = logged
    base = load_policy(base_model, device="cpu")
    before = task.accuracy(base.model, base.tokenizer, held_out)
    assert before <= 0.1  # the base copies: the greedy answer is wrong
    assert 0.05 < sum(e["reward"] for e in episodes) / len(episodes) < 0.5  # but it samples the reversal

    model, tok, result, tracker = train(base_model, episodes, drop_behavior_every=drop_behavior_every)
    after = task.accuracy(model, tok, held_out)
    print(f"greedy accuracy {before:.2f} -> {after:.2f}")
    assert after >= before + 0.4, f"greedy accuracy on held-out prompts {before:.2f} -> {after:.2f}"
    approx = [m["recomputed_behavior_frac"] for _, m in tracker.metrics]
    assert (sum(approx) / len(approx) > 0.3) == bool(drop_behavior_every)
    assert {"loss", "kl_behavior", "clip_frac", "entropy", "tokens_per_s", "grad_norm"} <= set(tracker.metrics[0][1])


def test_save_load_continue_reproduces_training_straight_through(base_model, logged, tmp_path):
    episodes = logged[0][:96]
    cfg = CFG.model_copy(
        update={"max_steps": 4, "checkpoint_every": 2, "lora_dropout": 0.1, "epochs": 1, "batch_tokens": 256}
    )
    straight, _, _, _ = train(base_model, episodes, cfg, checkpoint_dir=tmp_path / "a")
    ckpt = tmp_path / "a" / "step-2"
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and (ckpt / "trainer.safetensors").is_file()

    policy = load_policy(base_model, device="cpu")  # a fresh process would do exactly this
    resumed = load_adapter(policy.model, ckpt / "adapter")
    eps = tokenized(policy.tokenizer, episodes)
    result = train_policy(
        resumed,
        eps,
        [e["reward"] for e in episodes],
        [e["group"] for e in episodes],
        cfg,
        MemoryTracker(),
        policy.tokenizer.pad_token_id,
        resume_from=ckpt,
    )
    assert result.steps == 4 and len(result.history) == 2  # steps 3 and 4 only

    a = {k: v for k, v in straight.state_dict().items() if "lora_" in k}
    b = {k: v for k, v in resumed.state_dict().items() if "lora_" in k}
    assert a.keys() == b.keys() and a
    moved = load_file(str(ckpt / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(a[k], moved[k.replace(".default", "")]) for k in a if k.replace(".default", "") in moved)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_micro_batch_masks_line_up_with_target_tokens():
    from train.data import TokenizedEpisode

    eps = [
        TokenizedEpisode("a", [5, 6, 7, 8], [0, 0, 1, 1], [0, 0, -0.5, -0.25], "served_ids"),
        TokenizedEpisode("b", [5, 9, 10, 11, 12, 13], [0, 1, 0, 0, 1, 1], None, "missing"),
    ]
    batch = collate(eps, [0, 1], pad_id=0, device="cpu")
    assert batch.input_ids.shape == (2, 6) and batch.mask.shape == (2, 5)
    for b, e in enumerate(eps):
        for t in range(5):  # position t scores token t + 1
            expected = e.loss_mask[t + 1] if t + 1 < len(e.input_ids) else 0
            assert batch.mask[b, t] == expected
    assert batch.behavior[0].tolist() == [0.0, -0.5, -0.25, 0.0, 0.0]
    assert batch.has_behavior.tolist() == [True, False]
    # KTO's mismatched pairs: a's prompt, b's completion (from b's first assistant token on)
    pair = mismatched_pairs(eps, [0, 1])[0]
    assert pair.input_ids == [5, 6, 9, 10, 11, 12, 13] and pair.loss_mask == [0, 0, 1, 0, 0, 1, 1]


def test_pack_respects_the_token_budget_and_is_a_function_of_seed_and_epoch():
    lengths = [3, 10, 4, 8, 8, 2, 9, 1]
    batches = pack(lengths, batch_tokens=20, seed=3, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(8))
    assert all(max(lengths[i] for i in b) * len(b) <= 20 for b in batches)
    assert batches == pack(lengths, 20, 3, 0) and batches != pack(lengths, 20, 3, 1)


def test_grouped_pack_pads_less_and_keeps_every_episode_once_per_epoch():
    # an agent's calls: long tool calls and short answers, mixed
    rng = random.Random(0)
    lengths = [rng.choice([rng.randint(50, 60), rng.randint(8, 12)]) for _ in range(400)]
    plain = pack(lengths, batch_tokens=256, seed=1, epoch=0)
    grouped = pack(lengths, batch_tokens=256, seed=1, epoch=0, grouped=True)
    assert sorted(i for b in grouped for i in b) == list(range(400))
    assert all(max(lengths[i] for i in b) * len(b) <= 256 for b in grouped)

    def padded(batches):
        return sum(max(lengths[i] for i in b) * len(b) for b in batches)

    assert padded(grouped) < 0.75 * padded(plain)
    assert grouped == pack(lengths, 256, 1, 0, grouped=True) != pack(lengths, 256, 1, 1, grouped=True)
    # the micro-batches are shuffled again: not in length order, so steps alternate lengths
    longest = [max(lengths[i] for i in b) for b in grouped]
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)


def test_missing_or_corrupt_adapter_is_a_model_error(base_model, tmp_path):
    policy = load_policy(base_model, device="cpu")
    with pytest.raises(ModelError, match=str(tmp_path / "none")):
        load_adapter(policy.model, tmp_path / "none")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot load the adapter"):
        load_adapter(policy.model, bad)


@pytest.mark.parametrize(
    "loss,kl_coef", [("grpo", 0.0), ("dr_grpo", 0.0), ("dapo", 0.0), ("kto", 0.0), ("cispo", 0.05)]
)
def test_every_loss_of_the_table_trains_in_the_loop(base_model, logged, loss, kl_coef):
    episodes = logged[0][:64]
    cfg = CFG.model_copy(update={"loss": loss, "kl_coef": kl_coef, "epochs": 1, "max_steps": 2, "batch_tokens": 256})
    model, _, result, tracker = train(base_model, episodes, cfg)
    assert result.steps == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for _, m in tracker.metrics)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # LoRA B starts at zero: the update moved it
    assert ("kl" in tracker.metrics[-1][1]) == (kl_coef > 0)


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo"])
def test_dr_grpo_trains_on_advantages_not_divided_by_the_std(base_model, logged, loss):
    """Dr. GRPO (arXiv:2503.20783, eq. 3) centres the rewards and stops there: with every episode
    against the batch, a step's advantages spread exactly as its rewards do. GRPO divides by
    the std, so its spread is not the rewards' (their std is ~0.5 here, not 1)."""
    cfg = CFG.model_copy(update={"loss": loss, "advantage": "batch", "epochs": 1, "max_steps": 2, "batch_tokens": 256})
    *_, tracker = train(base_model, logged[0][:64], cfg)
    spread = [(m["advantage_std"], m["reward_std"]) for _, m in tracker.metrics if "advantage_std" in m]
    assert spread and all(r > 0.05 for _, r in spread)
    unscaled = all(a == pytest.approx(r, abs=1e-5) for a, r in spread)
    assert unscaled == (loss == "dr_grpo"), spread


@pytest.mark.parametrize("loss", ["cispo", "grpo", "dr_grpo", "dapo", "kto"])
def test_a_step_gradient_does_not_depend_on_packing(base_model, logged, loss):
    """One optimizer step over 8 episodes as one micro-batch of 8 and as four of 2: the same
    gradient (each micro-batch used to be normalised by itself, then divided by their number)."""
    from train.importance import advantages
    from train.loop import StepInputs, accumulate_step, correction_config, loss_config
    from train.losses import get_loss
    from train.sampling import SamplingRows

    policy = load_policy(base_model, device="cpu")
    episodes = []
    for k, e in enumerate([e for e in logged[0] if len(e["completion_token_ids"]) >= 3][:8]):
        n = 1 + k % 3  # completions of 1-3 tokens: packing changes the padding and the normalisers
        ids = e["completion_token_ids"][:n]
        episodes.append(
            {
                **e,
                "completion_token_ids": ids,
                "completion": policy.tokenizer.decode(ids),
                "behavior_logprobs": e["behavior_logprobs"][:n],
            }
        )
    cfg = CFG.model_copy(update={"loss": loss, "kl_coef": 0.05 if loss == "kto" else 0.0})
    torch.manual_seed(0)
    model = attach_adapter(policy.model, cfg)
    with torch.no_grad():  # LoRA B starts at zero; non-zero, every adapter weight gets a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    model.eval()  # no dropout: both runs see the same function
    eps = tokenized(policy.tokenizer, episodes)
    assert len({len(e.input_ids) for e in eps}) == 3 and all(e.behavior is not None for e in eps)
    rewards = [1.0, -0.5, 0.25, 0.0, -1.0, 0.5, 1.0, -0.25]  # one KTO tie among them
    inputs = StepInputs(
        advantages(rewards, ["all"] * 8), torch.tensor(rewards), SamplingRows.of(eps), torch.zeros(8, dtype=torch.bool)
    )
    entry = get_loss(loss)
    lcfg = loss_config(cfg, max(sum(e.loss_mask) for e in eps), entry)

    def gradient(micro):
        model.zero_grad(set_to_none=True)
        accumulate_step(
            model, eps, micro, inputs, entry, lcfg, correction_config(entry, cfg), cfg, policy.tokenizer.pad_token_id
        )
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    whole = gradient([list(range(8))])
    packed = gradient([[0, 1], [2, 3], [4, 5], [6, 7]])
    assert any(g.abs().sum() > 0 for g in whole.values())
    for name, g in whole.items():
        torch.testing.assert_close(packed[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_bf16_weights_train_float32_lora_and_checkpointing_gives_the_same_gradient(base_model, logged):
    from train.logprobs import token_logprobs
    from train.lora import set_gradient_checkpointing
    from train.sampling import SamplingRows

    # bf16 weights (what CUDA loads): the LoRA parameters the optimizer updates stay float32
    half = attach_adapter(load_policy(base_model, device="cpu", dtype=torch.bfloat16).model, CFG)
    trainable = [p for p in half.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
    assert any(p.dtype == torch.bfloat16 for p in half.parameters() if not p.requires_grad)

    policy = load_policy(base_model, device="cpu")
    torch.manual_seed(0)
    model = attach_adapter(policy.model, CFG.model_copy(update={"lora_dropout": 0.0}))
    eps = tokenized(policy.tokenizer, logged[0][:8])
    batch = collate(eps, list(range(8)), policy.tokenizer.pad_token_id, "cpu")
    grads = []
    for on in (False, True):
        set_gradient_checkpointing(model, on)
        model.train()
        model.zero_grad(set_to_none=True)
        (token_logprobs(model, batch, SamplingRows.of(eps))[0] * batch.mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert getattr(model.base_model.model, "is_gradient_checkpointing", False)
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=1e-6)
