"""Policy losses in one table: name -> (per-token loss, aggregation).

Every per-token function takes the same tensors and returns a [B, T] loss; every aggregation
reduces a [B, T] loss over the completion mask to a scalar (KTO's works per sequence). The importance ratio is taken
against the *behaviour* log-probs — what the serving policy assigned when it sampled, as
logged in production — so the data may be off-policy.

    logp      [B, T]  log pi_theta(token) under the policy being trained (requires grad)
    behavior  [B, T]  log mu(token) at serving time (no grad)
    adv       [B]     advantage of each sequence
    mask      [B, T]  1.0 for completion tokens that carry loss (assistant tokens), else 0.0

    cispo    MiniMax-M1, "Scaling Test-Time Compute Efficiently with Lightning Attention",
             arXiv:2506.13585: clip the importance weight and stop its gradient, keep the
             log-prob gradient of every token:  -sg(min(r, eps_high)) * A * logp
    grpo     DeepSeekMath, arXiv:2402.03300: PPO's clipped surrogate, mean over each
             sequence's tokens, then over sequences
    dr_grpo  "Understanding R1-Zero-Like Training", arXiv:2503.20783: the same surrogate
             summed and divided by a constant (B x max completion length): no length bias
    dapo     DAPO, arXiv:2503.14476: the clipped surrogate (asymmetric eps), mean over all
             tokens of the batch
    kto      KTO, arXiv:2402.01306, eq. (7): for binary feedback (A > 0 desirable, else not),
             a sigmoid of the sequence log-ratio to the reference policy (the base model, adapter
             off) around a KL reference point z:  w_d (1 - s(b (r - z)))  /  w_u (1 - s(b (z - r)))
             extra inputs: ref_logp [B] (reference log-prob of each completion), kl_ref [] (z)

Each matches TRL's GRPOTrainer (loss_type of the same name) to float precision; see
tests/test_losses.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


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
    # mean over each sequence's tokens, then over sequences (GRPO; long answers weigh less per token)
    return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def token_mean(loss, mask, cfg: LossConfig, **_) -> torch.Tensor:
    # every token of the batch weighs the same (DAPO, CISPO)
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def constant_normalizer(loss, mask, cfg: LossConfig, **_) -> torch.Tensor:
    # a fixed denominator: neither length nor batch composition biases the gradient (Dr. GRPO)
    return (loss * mask).sum() / (loss.size(0) * cfg.max_completion_length)


def kto_aggregate(loss, mask, cfg: LossConfig, *, adv, ref_logp, kl_ref, **_) -> torch.Tensor:
    logratio = (loss * mask).sum(-1) - ref_logp  # [B]: log pi(y|x) - log pi_ref(y|x)
    z = kl_ref.detach().clamp(min=0)  # the reference point: no gradient through it
    desirable = cfg.kto_desirable_weight * (1 - torch.sigmoid(cfg.kto_beta * (logratio - z)))
    undesirable = cfg.kto_undesirable_weight * (1 - torch.sigmoid(cfg.kto_beta * (z - logratio)))
    return torch.where(adv > 0, desirable, undesirable).mean()


PerToken = Callable[..., torch.Tensor]
Aggregate = Callable[[torch.Tensor, torch.Tensor, LossConfig], torch.Tensor]

LOSSES: dict[str, tuple[PerToken, Aggregate]] = {
    "cispo": (cispo_per_token, token_mean),
    "grpo": (clipped_surrogate_per_token, sequence_mean),
    "dr_grpo": (clipped_surrogate_per_token, constant_normalizer),
    "dapo": (clipped_surrogate_per_token, token_mean),
    "kto": (kto_per_token, kto_aggregate),
}


def policy_loss(name: str, logp, behavior, adv, mask, cfg: LossConfig = LossConfig(), **extra) -> torch.Tensor:
    """The scalar loss `name` from the table; `extra` holds a loss's own inputs (KTO's)."""
    try:
        per_token, aggregate = LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss {name!r}: choose one of {', '.join(LOSSES)}") from None
    return aggregate(per_token(logp, behavior, adv, mask, cfg, **extra), mask, cfg, adv=adv, **extra)
