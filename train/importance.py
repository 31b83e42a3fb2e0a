"""Importance correction for logged production data, and advantages.

Production episodes were sampled by whatever policy was serving (mu), with its per-token
log-probs logged. The losses take the ratio pi_theta / mu per token; before that, the
*correction* here bounds how far off-policy data may pull the update:

    token truncate   w_t = min(r_t, C)                         (truncated IS, Ionides 2008)
    token mask       tokens with r_t outside [lo, hi] carry no loss
    sequence ...     the same on the sequence ratio exp(mean_t log r_t) (geometric mean),
                     applied to all of a sequence's tokens (as in GSPO, arXiv:2507.18071)

It returns a per-token weight [B, T] (no gradient) to multiply into the per-token loss, the
mask to use, and counts for the run's metrics. With mu = pi_theta every ratio is 1 and the
correction is the identity.

Advantages: group-relative (reward minus its task-group mean, over the group's std) where a
task was sampled several times, batch-relative otherwise (GRPO, arXiv:2402.03300); the calls of
an agent episode count once in their group's mean and std (see advantages()). Dr. GRPO
(arXiv:2503.20783, eq. 3) keeps the difference from the mean and drops the division by the std:
a group whose rewards barely differ would otherwise weigh as much as one whose rewards differ a
lot (its "question-level difficulty bias"); `scale=False` (the loss table's `scale_advantages`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class CorrectionConfig:
    token_truncate: float | None = 2.0
    token_mask: tuple[float, float] | None = None  # (lo, hi)
    sequence_truncate: float | None = None
    sequence_mask: tuple[float, float] | None = (0.1, 10.0)


@dataclass
class CorrectionStats:
    tokens: int = 0
    truncated_tokens: int = 0
    masked_tokens: int = 0
    sequences: int = 0
    truncated_sequences: int = 0
    masked_sequences: int = 0
    log_ratio_mean: float = 0.0
    log_ratio_min: float = 0.0
    log_ratio_max: float = 0.0


def correct(
    logp: torch.Tensor, behavior: torch.Tensor, mask: torch.Tensor, cfg: CorrectionConfig
) -> tuple[torch.Tensor, torch.Tensor, CorrectionStats]:
    """(weight [B, T], mask [B, T], stats) for logp, behavior, mask of shape [B, T]."""
    with torch.no_grad():
        log_r = (logp - behavior) * mask  # [B, T]
        r = torch.exp(log_r)
        weight = torch.ones_like(r)
        new_mask = mask.clone()
        valid = mask > 0
        stats = CorrectionStats(tokens=int(valid.sum()), sequences=int((mask.sum(-1) > 0).sum()))
        if stats.tokens:
            stats.log_ratio_mean = float(log_r[valid].mean())
            stats.log_ratio_min, stats.log_ratio_max = float(log_r[valid].min()), float(log_r[valid].max())
        if cfg.token_truncate is not None:
            over = (r > cfg.token_truncate) & valid
            weight = torch.where(over, cfg.token_truncate / r, weight)  # r * w = C
            stats.truncated_tokens = int(over.sum())
        if cfg.token_mask is not None:
            lo, hi = cfg.token_mask
            out = ((r < lo) | (r > hi)) & valid
            new_mask = new_mask * (~out)
            stats.masked_tokens = int(out.sum())
        seq_r = torch.exp(log_r.sum(-1) / mask.sum(-1).clamp(min=1.0))  # [B] geometric mean ratio
        has_tokens = mask.sum(-1) > 0
        if cfg.sequence_truncate is not None:
            over = (seq_r > cfg.sequence_truncate) & has_tokens
            weight = weight * torch.where(over, cfg.sequence_truncate / seq_r, 1.0).unsqueeze(1)
            stats.truncated_sequences = int(over.sum())
        if cfg.sequence_mask is not None:
            lo, hi = cfg.sequence_mask
            out = ((seq_r < lo) | (seq_r > hi)) & has_tokens
            new_mask = new_mask * (~out).unsqueeze(1)
            stats.masked_sequences = int(out.sum())
    return weight, new_mask, stats


def advantages(
    rewards: Sequence[float],
    groups: Sequence[str],
    mode: Literal["auto", "group", "batch"] = "auto",
    eps: float = 1e-6,
    episodes: Sequence[str | None] | None = None,
    scale: bool = True,
) -> torch.Tensor:
    """[N] advantages (over their group's std unless `scale` is False). `groups` names each
    episode's task. `auto`: tasks sampled two or more times are normalised within their group,
    single samples against the batch of single samples; `group`: single samples get 0;
    `batch`: everything against the batch.

    `episodes` names each item's agent episode (None: a call that is its own episode). The
    calls of one episode count once: a group's mean and std are over its episodes (each
    episode's mean reward), and each call's reward is compared with them -- a call's advantage
    is its episode's (all of it, with equal credit and nothing of the call's own), moved by
    what is the call's own (a guard on it); an agent that makes many calls does not outweigh
    one that makes few in its task's baseline. A task with one episode, however many calls,
    is a single sample."""
    r = torch.tensor(list(rewards), dtype=torch.float32)
    unit = (
        [e if e is not None else f"#{i}" for i, e in enumerate(episodes)]
        if episodes is not None
        else [f"#{i}" for i in range(len(r))]
    )
    if mode == "batch":
        return _against_episodes(r, list(range(len(r))), unit, eps, scale)
    members: dict[str, list[int]] = defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    out = torch.zeros_like(r)
    singles: list[int] = []
    for idx in members.values():
        if len({unit[i] for i in idx}) > 1:
            out[idx] = _against_episodes(r, idx, unit, eps, scale)
        elif mode == "auto":
            singles.extend(idx)
    if singles:
        out[singles] = _against_episodes(r, singles, unit, eps, scale)
    return out


def _against_episodes(r: torch.Tensor, idx: list[int], unit: list[str], eps: float, scale: bool) -> torch.Tensor:
    """r[idx] against the mean (and, with `scale`, the std) of its episodes' mean rewards (one
    value per episode)."""
    by_episode: dict[str, list[int]] = defaultdict(list)
    for i in idx:
        by_episode[unit[i]].append(i)
    if len(by_episode) < 2:
        return torch.zeros(len(idx))  # one episode has nothing to be compared with
    means = torch.stack([r[calls].mean() for calls in by_episode.values()])  # [episodes]
    centred = r[idx] - means.mean()
    return centred / (means.std(unbiased=False) + eps) if scale else centred
