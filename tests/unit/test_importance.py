"""Importance correction against behaviour log-probs, and advantages."""

from __future__ import annotations

import math

import pytest
import torch

from train.importance import CorrectionConfig, advantages, correct
from train.losses import LossConfig, policy_loss


def batch():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 5, generator=g) * 2
    mask = torch.ones(3, 5)
    mask[2, 3:] = 0
    return logp, mask


def test_on_policy_the_correction_is_the_identity_and_the_loss_unchanged():
    logp, mask = batch()
    logp.requires_grad_(True)
    cfg = CorrectionConfig(token_truncate=2.0, token_mask=(0.5, 2.0), sequence_truncate=2.0, sequence_mask=(0.5, 2.0))
    weight, new_mask, stats = correct(logp, logp.detach(), mask, cfg)
    assert torch.equal(weight, torch.ones_like(weight)) and torch.equal(new_mask, mask)
    assert (stats.truncated_tokens, stats.masked_tokens, stats.masked_sequences) == (0, 0, 0)
    assert stats.log_ratio_mean == 0.0
    adv = torch.tensor([1.0, -1.0, 0.5])
    plain = policy_loss("cispo", logp, logp.detach(), adv, mask, LossConfig(epsilon_high=5.0))
    # the per-token loss times the weight, aggregated over the corrected mask: the same loss
    from train.losses import LOSSES

    cispo = LOSSES["cispo"]
    corrected = cispo.aggregate(
        cispo.per_token(logp, logp.detach(), adv, mask, LossConfig(epsilon_high=5.0)) * weight, new_mask, LossConfig()
    ) / cispo.count(new_mask, LossConfig())
    assert corrected.item() == pytest.approx(plain.item())


def test_shifted_behaviour_truncation_and_masking_counts_follow_the_thresholds():
    logp, mask = batch()
    shift = torch.tensor(
        [
            [-1.0, 0.0, 0.1, 2.0, -3.0],  # ratios e^1, 1, e^-0.1, e^-2, e^3
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [-5.0, -5.0, -5.0, 9.0, 9.0],
        ]
    )  # last two are padding
    behavior = logp + shift  # log r = -shift
    cfg = CorrectionConfig(
        token_truncate=2.0, token_mask=(0.2, 10.0), sequence_truncate=None, sequence_mask=(0.5, 20.0)
    )
    weight, new_mask, stats = correct(logp, behavior, mask, cfg)
    r = torch.exp(-shift)
    valid = mask > 0
    assert stats.tokens == 13
    assert stats.truncated_tokens == int(((r > 2.0) & valid).sum()) == 5  # e^1, e^3, and row 3's e^5 x3
    assert stats.masked_tokens == int((((r < 0.2) | (r > 10.0)) & valid).sum()) == 5
    # sequence ratios: exp(mean log r) = row 0: e^(2.1/5), row 1: 1, row 2: e^5 ~ 148 -> masked
    assert stats.masked_sequences == 1 and new_mask[2].sum() == 0
    assert weight[0, 0].item() == pytest.approx(2.0 / math.e)  # r * w = the cap
    assert weight[1].tolist() == [1.0] * 5


def test_advantages_group_relative_where_possible_batch_relative_otherwise():
    rewards = [1.0, 0.0, 1.0, 0.5, -0.5, 0.2]
    groups = ["p1", "p1", "p1", "p2", "p3", "p4"]
    a = advantages(rewards, groups)
    g = torch.tensor([1.0, 0.0, 1.0])
    torch.testing.assert_close(a[:3], (g - g.mean()) / (g.std(unbiased=False) + 1e-6))
    s = torch.tensor([0.5, -0.5, 0.2])
    torch.testing.assert_close(a[3:], (s - s.mean()) / (s.std(unbiased=False) + 1e-6))
    assert advantages(rewards, groups, mode="group")[3:].tolist() == [0.0, 0.0, 0.0]
    b = torch.tensor(rewards)
    torch.testing.assert_close(
        advantages(rewards, groups, mode="batch"), (b - b.mean()) / (b.std(unbiased=False) + 1e-6)
    )
    assert advantages([0.3], ["x"]).tolist() == [0.0]


def test_unscaled_advantages_are_the_rewards_less_their_group_mean():
    """Dr. GRPO's advantage (arXiv:2503.20783, eq. 3): R - mean(R) of the group, no std."""
    rewards = [1.0, 0.0, 1.0, 0.5, -0.5, 0.2]
    groups = ["p1", "p1", "p1", "p2", "p3", "p4"]
    a = advantages(rewards, groups, scale=False)
    torch.testing.assert_close(a, torch.tensor([1 / 3, -2 / 3, 1 / 3, 0.5 - 0.2 / 3, -0.5 - 0.2 / 3, 0.2 - 0.2 / 3]))
    # an agent's episode still counts once in its group's mean
    a = advantages([1.0, 0.5, 1.0, -1.0], ["task"] * 4, episodes=["A", "A", "A", "B"], scale=False)
    torch.testing.assert_close(a, torch.tensor([1.0, 0.5, 1.0, -1.0]) - (2.5 / 3 - 1.0) / 2)


def test_an_agent_episode_counts_once_in_its_task_s_baseline():
    """Two episodes of one task: A (3 calls, outcome +1) and B (1 call, outcome -1). By calls, A
    would set the baseline at +0.5; by episodes it is 0, and every call gets its episode's
    advantage -- but for what is its own (a guard on A's second call)."""
    rewards = [1.0, 0.5, 1.0, -1.0]
    groups = ["task"] * 4
    a = advantages(rewards, groups, episodes=["A", "A", "A", "B"])
    means = torch.tensor([2.5 / 3, -1.0])
    expected = (torch.tensor(rewards) - means.mean()) / (means.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(a, expected)
    assert a[0] == a[2] > a[1] > 0 > a[3]
    # without episodes, each call is a sample of its own, as before
    torch.testing.assert_close(advantages(rewards, groups), advantages(rewards, groups, episodes=[None] * 4))
    # one episode of a task, however many calls, is a single sample (batch-relative in auto)
    assert advantages([1.0, 0.0], ["t", "t"], mode="group", episodes=["E", "E"]).tolist() == [0.0, 0.0]
