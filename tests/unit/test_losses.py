"""Parity with TRL: each loss in the table against TRL's own GRPOTrainer._compute_loss (the
installed trl, called with a stand-in for the trainer), loss and gradients to 1e-5 in float32,
with masked padding and ratios far outside the clip range."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.grpo_trainer import GRPOTrainer
from trl.trainer.kto_trainer import KTOTrainer

from train.losses import LOSSES, LossConfig, policy_loss

B, T = 4, 7
CFG = LossConfig(epsilon_low=0.2, epsilon_high=0.28, max_completion_length=T)


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)  # [B, T]
    behavior = logp.detach() + torch.randn(B, T, generator=g) * 0.3
    behavior[0, :3] = logp.detach()[0, :3] - 2.0  # ratio e^2 ~ 7.4: far above the clip range
    behavior[1, :2] = logp.detach()[1, :2] + 2.0  # ratio e^-2 ~ 0.14: far below it
    mask = torch.ones(B, T)
    mask[2, 4:] = 0.0  # padding
    mask[3, 1:] = 0.0  # a one-token completion
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])  # [B]
    return logp, behavior, adv, mask


def trl_loss(loss_type: str, logp, behavior, adv, mask) -> torch.Tensor:
    """TRL's _compute_loss with our tensors in place of a model's, everything else off."""
    identity = lambda x, **_: x  # noqa: E731 - one process: gather/reduce are the identity
    fake = SimpleNamespace(
        loss_type=loss_type,
        importance_sampling_level="token",
        epsilon_low=CFG.epsilon_low,
        epsilon_high=CFG.epsilon_high,
        beta=0.0,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        aux_loss_enabled=False,
        _entropy_bonus_enabled=False,
        max_completion_length=CFG.max_completion_length,
        current_gradient_accumulation_steps=1,
        model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=1),
        accelerator=SimpleNamespace(
            num_processes=1, gather=identity, reduce=identity, gather_for_metrics=identity, sync_gradients=True
        ),
        _metrics={"train": defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": behavior,
        "num_items_in_batch": mask.sum(),
    }
    return GRPOTrainer._compute_loss(fake, None, inputs)


GRPO_FAMILY = ["cispo", "dapo", "dr_grpo", "grpo"]


@pytest.mark.parametrize("name", GRPO_FAMILY)
def test_loss_and_gradients_match_trl(name):
    logp, behavior, adv, mask = batch()
    ours = policy_loss(name, logp, behavior, adv, mask, CFG)
    (grad_ours,) = torch.autograd.grad(ours, logp)
    theirs = trl_loss(name, logp, behavior, adv, mask)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    torch.testing.assert_close(grad_ours, grad_theirs, atol=1e-5, rtol=0)
    assert grad_ours[2, 4:].abs().sum() == 0 and grad_ours[3, 1:].abs().sum() == 0  # padding: no gradient


@pytest.mark.parametrize("name", GRPO_FAMILY)
def test_on_policy_every_ratio_is_one_and_the_gradient_is_the_policy_gradient(name):
    logp, _, adv, mask = batch()
    behavior = logp.detach()  # the behaviour policy is the current one
    cfg = LossConfig(epsilon_high=5.0, max_completion_length=T)  # CISPO's weight bound above 1
    assert torch.equal(torch.exp(logp - behavior), torch.ones(B, T))
    (grad,) = torch.autograd.grad(policy_loss(name, logp, behavior, adv, mask, cfg), logp)
    # the plain policy gradient -A * logp, aggregated the same way
    entry = LOSSES[name]
    plain = entry.aggregate(-adv.unsqueeze(1) * logp, mask, cfg) / entry.count(mask, cfg)
    (expected,) = torch.autograd.grad(plain, logp)
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_unknown_loss_is_refused_with_the_choices():
    logp, behavior, adv, mask = batch()
    with pytest.raises(ValueError, match="choose one of cispo, grpo, dr_grpo, dapo, kto"):
        policy_loss("ppo", logp, behavior, adv, mask)


def trl_kto_loss(logp, mask, label, ref_logp, kl_logps, ref_kl_logps, beta, w_d, w_u) -> torch.Tensor:
    """TRL's KTOTrainer._compute_loss, with a stand-in model that returns our per-token
    log-probs (TRL shifts by one position: sequences are one token longer than the logps)."""
    identity = lambda x, **_: x  # noqa: E731
    per_token = logp * mask  # what the fused LM head returns: 0 where labels are -100

    def model(**_):
        return SimpleNamespace(
            log_probs=per_token, entropy=torch.zeros_like(per_token), mean_logits=torch.zeros_like(per_token)
        )

    fake = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=identity),
        loss_type="kto",
        beta=beta,
        desirable_weight=w_d,
        undesirable_weight=w_u,
        calculate_KL=True,
        precompute_ref_logps=True,
        aux_loss_enabled=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
        _compute_kl_logps=lambda model, batch: kl_logps,
    )
    ones = torch.ones(B, T + 1, dtype=torch.long)
    completion_mask = torch.cat([torch.zeros(B, 1, dtype=torch.long), mask.long()], dim=1)
    inputs = {
        "input_ids": ones,
        "attention_mask": ones,
        "completion_mask": completion_mask,
        "label": label,
        "ref_logps": ref_logp,
        "ref_KL_logps": ref_kl_logps,
    }
    return KTOTrainer._compute_loss(fake, model, inputs, return_outputs=False)


def test_kto_loss_and_gradients_match_trl():
    logp, _, _, mask = batch(1)
    label = torch.tensor([True, False, True, False])
    g = torch.Generator().manual_seed(5)
    ref_logp = (logp.detach() * mask).sum(-1) + torch.randn(B, generator=g)  # [B]
    kl_logps, ref_kl_logps = -torch.rand(B, generator=g) * 5, -torch.rand(B, generator=g) * 5
    cfg = LossConfig(kto_beta=0.3, kto_desirable_weight=1.0, kto_undesirable_weight=1.5)
    ours = policy_loss(
        "kto",
        logp,
        None,
        torch.zeros(B),
        mask,
        cfg,
        label=torch.where(label, 1.0, -1.0),
        ref_logp=ref_logp,
        kl_ref=(kl_logps - ref_kl_logps).mean(),
    )
    (grad_ours,) = torch.autograd.grad(ours, logp)
    theirs = trl_kto_loss(logp, mask, label, ref_logp, kl_logps, ref_kl_logps, 0.3, 1.0, 1.5)
    (grad_theirs,) = torch.autograd.grad(theirs, logp)
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    torch.testing.assert_close(grad_ours, grad_theirs, atol=1e-5, rtol=0)
    assert grad_ours[2, 4:].abs().sum() == 0  # padding: no gradient


def test_kto_ties_carry_no_loss_and_are_not_counted():
    """A reward of exactly 0 is neither desirable nor undesirable: it used to be pushed down."""
    logp, _, _, mask = batch(1)
    g = torch.Generator().manual_seed(5)
    ref_logp = (logp.detach() * mask).sum(-1) + torch.randn(B, generator=g)
    kw = dict(ref_logp=ref_logp, kl_ref=torch.tensor(0.3))
    cfg = LossConfig(kto_beta=0.3)
    with_tie = policy_loss(
        "kto", logp, None, torch.zeros(B), mask, cfg, label=torch.tensor([1.0, -1.0, 0.0, 0.0]), **kw
    )
    (grad,) = torch.autograd.grad(with_tie, logp)
    assert grad[2:].abs().sum() == 0  # the ties: no gradient
    first_two = policy_loss(
        "kto",
        logp[:2],
        None,
        torch.zeros(2),
        mask[:2],
        cfg,
        label=torch.tensor([1.0, -1.0]),
        ref_logp=ref_logp[:2],
        kl_ref=torch.tensor(0.3),
    )
    assert with_tie.item() == pytest.approx(first_two.item())  # the mean is over the labelled two


@pytest.mark.parametrize("r", [0.5, 1.0, 3.0, 8.0])
def test_each_loss_sees_one_importance_correction(r):
    """The effective per-token gradient weight d loss / d logp of one token, through the loop's
    composition (losses.LOSSES + importance.correct): CISPO's is -sg(min(r, cap)) * A as in its
    paper (it was also truncated at token_truncate = 2 and damped by 2/r above it); the
    clipped surrogate with a negative advantage takes the token truncation: r * A -> min(r, C) * A
    (and PPO's own clip below 1 - eps)."""
    from pipeline.core.config import TrainConfig
    from train.importance import correct
    from train.loop import correction_config

    cfg = TrainConfig(cispo_weight_cap=5.0, token_truncate=2.0, sequence_mask=None)
    for name, adv, expected in (
        ("cispo", 1.0, -min(r, 5.0)),
        ("cispo", -1.0, min(r, 5.0)),
        ("dapo", -1.0, 0.0 if r < 0.8 else min(r, 2.0)),
    ):  # below 1 - eps: PPO's clip
        logp = torch.full((1, 1), -1.0, requires_grad=True)
        behavior = logp.detach() - math.log(r)
        mask = torch.ones(1, 1)
        entry = LOSSES[name]
        lcfg = LossConfig(epsilon_low=0.2, epsilon_high=5.0 if name == "cispo" else 0.28)
        weight, new_mask, _ = correct(logp, behavior, mask, correction_config(entry, cfg))
        per_token = entry.per_token(logp, behavior, torch.tensor([adv]), new_mask, lcfg) * weight
        value = entry.aggregate(per_token, new_mask, lcfg) / entry.count(new_mask, lcfg)
        (grad,) = torch.autograd.grad(value, logp)
        # d/dlogp of the surrogate r*A is r*A (r = exp(logp - behavior)); CISPO's is its weight * A
        assert grad.item() == pytest.approx(expected, rel=1e-5), (name, adv, r)


def test_the_table_declares_each_loss_s_needs_and_the_config_and_cli_offer_its_names():
    from typing import get_args

    from pipeline.cli.train import run as train_run
    from pipeline.core.train_config import LossName, TrainConfig
    from train.loop import loss_config

    assert set(LOSSES) == set(get_args(LossName))
    option = next(p for p in train_run.params if p.name == "loss")
    assert set(option.type.choices) == set(LOSSES)
    cfg = TrainConfig(cispo_weight_cap=7.0, clip_high=0.3)
    # the upper bound on the importance weight is the key the loss names, not a branch on its name
    assert {name: loss_config(cfg, 8, loss).epsilon_high for name, loss in LOSSES.items()} == {
        "cispo": 7.0,
        "grpo": 0.3,
        "dr_grpo": 0.3,
        "dapo": 0.3,
        "kto": 0.3,
    }
    assert [n for n, loss in LOSSES.items() if loss.reference] == ["kto"]
