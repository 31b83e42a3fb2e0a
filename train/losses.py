"""Policy losses in one table: name -> a `Loss`, which says what it computes and what it needs.

Every per-token function takes the same tensors and returns a [B, T] loss; every aggregation
reduces it over the completion mask to the micro-batch's *sum*, and the table names the step's
denominator (`count`): the loop adds the counts of all micro-batches of an optimizer step
before the first backward pass and divides each micro-batch's sum by that total, so a step's
loss (and gradient) is the same however its episodes were packed into micro-batches. The
importance ratio is taken against the *behaviour* log-probs -- what the serving policy assigned
when it sampled, as logged in production -- so the data may be off-policy.

    logp      [B, T]  log pi_theta(token) under the policy being trained (requires grad)
    behavior  [B, T]  log mu(token) at serving time (no grad)
    adv       [B]     advantage of each sequence
    mask      [B, T]  1.0 for completion tokens that carry loss (assistant tokens), else 0.0

    cispo    MiniMax-M1, "Scaling Test-Time Compute Efficiently with Lightning Attention",
             arXiv:2506.13585: clip the importance weight and stop its gradient, keep the
             log-prob gradient of every token:  -sg(min(r, eps_high)) * A * logp, token mean.
             The weight cap *is* its truncation: importance.py's token truncation does not
             apply on top (it would cap the weight at token_truncate and damp high ratios by C/r)
    grpo     DeepSeekMath, arXiv:2402.03300: PPO's clipped surrogate, mean over each
             sequence's tokens, then over sequences
    dr_grpo  "Understanding R1-Zero-Like Training", arXiv:2503.20783: the same surrogate
             summed and divided by a constant (sequences x max completion length): no length
             bias; its advantages are not divided by the group's std (no difficulty bias)
    dapo     DAPO, arXiv:2503.14476: the clipped surrogate (asymmetric eps), mean over all
             tokens of the step
    kto      KTO, arXiv:2402.01306, eq. (7): for binary feedback, a sigmoid of the sequence
             log-ratio to the reference policy (the base model, adapter off) around a KL
             reference point z:  w_d (1 - s(b (r - z)))  /  w_u (1 - s(b (z - r)))
             extra inputs: label [B] (+1 desirable, -1 undesirable, 0 a tie: no loss, not
             counted), ref_logp [B] (reference log-prob of each completion), kl_ref [] (z)

The grpo family's surrogate takes importance.py's token truncation (a bound on how far one
off-policy token with a negative advantage can pull: r * A becomes C * A) and its sequence mask;
KTO compares with its reference policy, not with mu, and takes neither.

Each matches TRL (GRPOTrainer's loss_type of the same name, KTOTrainer) to float precision on
one micro-batch; see tests/unit/test_losses.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from pipeline.core.train_config import LossName


@dataclass(frozen=True)
class LossConfig:
    epsilon_low: float = 0.2  # PPO clip range below 1 (grpo family)
    # above 1 for the grpo family; for CISPO the upper bound of the weight itself (TRL uses the
    # one field for both; CISPO wants it well above 1, e.g. 5)
    epsilon_high: float = 0.28
    max_completion_length: int = 256  # dr_grpo's constant normaliser
    kto_beta: float = 0.1
    kto_desirable_weight: float = 1.0
    kto_undesirable_weight: float = 1.0


def ratio(logp: torch.Tensor, behavior: torch.Tensor) -> torch.Tensor:
    """Per-token importance ratio pi_theta / mu.  [B, T]"""
    return torch.exp(logp - behavior)


def cispo_per_token(logp, behavior, adv, mask, cfg: LossConfig, **_) -> torch.Tensor:
    weight = torch.clamp(ratio(logp, behavior), max=cfg.epsilon_high).detach()  # [B, T], no grad
    return -weight * adv.unsqueeze(1) * logp  # [B, T]


def clipped_surrogate_per_token(logp, behavior, adv, mask, cfg: LossConfig, **_) -> torch.Tensor:
    r = ratio(logp, behavior)  # [B, T]
    r_clipped = torch.clamp(r, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    a = adv.unsqueeze(1)  # [B, 1]
    return -torch.min(r * a, r_clipped * a)  # pessimistic of the two: [B, T]


def kto_per_token(logp, behavior, adv, mask, cfg: LossConfig, **_) -> torch.Tensor:
    # each completion token's log-prob; KTO works on their sum per sequence (the aggregation)
    return logp * mask  # [B, T]


def sequence_mean(loss, mask, cfg: LossConfig, **_) -> torch.Tensor:
    # mean over each sequence's tokens, summed over sequences (GRPO; long answers weigh less per token)
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()


def token_sum(loss, mask, cfg: LossConfig, **_) -> torch.Tensor:
    # every token weighs the same (DAPO, CISPO, Dr. GRPO): divided by the step's tokens, or a constant
    return (loss * mask).sum()


def kto_aggregate(loss, mask, cfg: LossConfig, *, label, ref_logp, kl_ref, **_) -> torch.Tensor:
    logratio = (loss * mask).sum(-1) - ref_logp  # [B]: log pi(y|x) - log pi_ref(y|x)
    z = kl_ref.detach().clamp(min=0)  # the reference point: no gradient through it
    desirable = cfg.kto_desirable_weight * (1 - torch.sigmoid(cfg.kto_beta * (logratio - z)))
    undesirable = cfg.kto_undesirable_weight * (1 - torch.sigmoid(cfg.kto_beta * (z - logratio)))
    return torch.where(label > 0, desirable, torch.where(label < 0, undesirable, 0.0)).sum()  # ties: 0


def count_tokens(mask, cfg: LossConfig, **_) -> torch.Tensor:
    return mask.sum()


def count_sequences(mask, cfg: LossConfig, **_) -> torch.Tensor:
    return torch.tensor(float(mask.size(0)))


def count_sequence_slots(mask, cfg: LossConfig, **_) -> torch.Tensor:
    # Dr. GRPO's constant: the longest completion the run allows, for every sequence
    return torch.tensor(float(mask.size(0) * cfg.max_completion_length))


def count_labelled(mask, cfg: LossConfig, *, label, **_) -> torch.Tensor:
    return (label != 0).sum().float()


PerToken = Callable[..., torch.Tensor]
Aggregate = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Loss:
    """One loss: its per-token term, its aggregation and the step denominator it needs, and
    which of the training loop's extras it takes."""

    per_token: PerToken
    aggregate: Aggregate  # [B, T] loss, mask -> the micro-batch's sum
    count: Aggregate  # mask -> the micro-batch's share of the step's denominator
    token_truncation: bool  # importance.py's token truncation multiplies into the per-token loss
    sequence_mask: bool  # sequences whose ratio to mu is far off carry no loss
    reference: bool  # needs the reference policy's log-probs and a KL reference point (KTO)
    labels: bool  # needs a desirable/undesirable label per sequence instead of the advantage
    # kl_coef's KL to the base: added per token before aggregating (TRL's GRPO), or "separate":
    # its own token-mean term (KTO sums its per-token values into the sequence log-ratio)
    kl: Literal["per_token", "separate"]
    clip: Literal["weight_cap", "ppo", None]  # which tokens the clip-fraction metric counts
    # the [train] key that bounds the importance weight from above: PPO's clip_high, or
    # CISPO's own cap (None: the loss takes no importance weight)
    upper_bound: Literal["clip_high", "cispo_weight_cap", None] = "clip_high"
    # advantages divided by their group's std (GRPO); Dr. GRPO keeps them unscaled (importance.py)
    scale_advantages: bool = True


_SURROGATE = dict(
    per_token=clipped_surrogate_per_token,
    token_truncation=True,
    sequence_mask=True,
    reference=False,
    labels=False,
    kl="per_token",
    clip="ppo",
)
LOSSES: dict[str, Loss] = {
    "cispo": Loss(
        cispo_per_token,
        token_sum,
        count_tokens,
        token_truncation=False,
        sequence_mask=True,
        reference=False,
        labels=False,
        kl="per_token",
        clip="weight_cap",
        upper_bound="cispo_weight_cap",
    ),
    "grpo": Loss(aggregate=sequence_mean, count=count_sequences, **_SURROGATE),
    "dr_grpo": Loss(aggregate=token_sum, count=count_sequence_slots, scale_advantages=False, **_SURROGATE),
    "dapo": Loss(aggregate=token_sum, count=count_tokens, **_SURROGATE),
    "kto": Loss(
        kto_per_token,
        kto_aggregate,
        count_labelled,
        token_truncation=False,
        sequence_mask=False,
        reference=True,
        labels=True,
        kl="separate",
        clip=None,
        upper_bound=None,
    ),
}
# the configuration's vocabulary of losses (train.loss, `rtrl train run --loss`) is this table's
if set(LOSSES) != set(get_args(LossName)):
    raise ImportError(
        f"train.loss accepts {get_args(LossName)} but the loss table has {tuple(LOSSES)}: "
        "add the loss to both (pipeline/core/train_config.py's LossName)"
    )


def get_loss(name: str) -> Loss:
    try:
        return LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}: choose one of {', '.join(LOSSES)}") from None


def policy_loss(name: str, logp, behavior, adv, mask, cfg: LossConfig = LossConfig(), **extra) -> torch.Tensor:
    """The scalar loss `name` of one batch that is a whole step; `extra` holds a loss's own
    inputs (KTO's)."""
    loss = get_loss(name)
    total = loss.aggregate(loss.per_token(logp, behavior, adv, mask, cfg, **extra), mask, cfg, adv=adv, **extra)
    return total / loss.count(mask, cfg, **extra).clamp(min=1.0)
