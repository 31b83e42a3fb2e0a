"""Tokenized episodes -> padded micro-batches under a token budget.

pack     shuffle (a function of seed and epoch only, so a resumed run sees the same order),
         then fill each micro-batch while  rows x longest row <= batch_tokens;
         `grouped`: in windows of GROUP_WINDOW micro-batches' worth of the shuffled
         episodes, sorted by length before filling, and the micro-batches shuffled again --
         an agent's short answers no longer pad to its long tool calls (HF Trainer's
         group_by_length; the padding cost half the tokens of the agent demo's steps)
         (pack_by_length: in length order instead, for inference)
collate  right-padded tensors; targets are shifted by one, so every per-token tensor the
         losses see has T = L - 1 columns:

         input_ids   [B, L]   attention [B, L]
         mask        [B, T]   1.0 where the target token is an assistant token (carries loss)
         behavior    [B, T]   serving-time log-prob of the target token (0.0 elsewhere)
         has_behavior [B]     False where the episode's behaviour log-probs were missing
                              or could not be aligned (trained on-policy-approximate)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from train.data import TokenizedEpisode


@dataclass
class MicroBatch:
    index: list[int]  # positions of these episodes in the run's episode list
    input_ids: torch.Tensor  # [B, L]
    attention: torch.Tensor  # [B, L]
    mask: torch.Tensor  # [B, T]
    behavior: torch.Tensor  # [B, T]
    has_behavior: torch.Tensor  # [B]

    @property
    def tokens(self) -> int:
        return int(self.attention.sum())


# micro-batches' worth of episodes sorted together: most micro-batches then hold one kind of
# episode, and which episodes meet in a step is still drawn anew each epoch
GROUP_WINDOW = 8


def pack(lengths: list[int], batch_tokens: int, seed: int, epoch: int, grouped: bool = False) -> list[list[int]]:
    """Episode indices per micro-batch for one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=generator).tolist()
    if not grouped:
        return _fill(order, lengths, batch_tokens)
    batches: list[list[int]] = []
    window: list[int] = []
    size = 0
    for i in order + [None]:
        if i is None or (window and size + lengths[i] > GROUP_WINDOW * batch_tokens):
            batches += _fill(sorted(window, key=lengths.__getitem__), lengths, batch_tokens)
            window, size = [], 0
        if i is not None:
            window.append(i)
            size += lengths[i]
    return [batches[k] for k in torch.randperm(len(batches), generator=generator).tolist()]


def pack_by_length(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Inference batches (no gradient, so no need to shuffle): episodes in length order, so
    each batch pads only up to lengths close to its own."""
    return _fill(sorted(range(len(lengths)), key=lengths.__getitem__), lengths, batch_tokens)


def _fill(order: list[int], lengths: list[int], batch_tokens: int) -> list[list[int]]:
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        grown = max(longest, lengths[i])
        if current and grown * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current, grown = [], lengths[i]
        current.append(i)
        longest = grown
    if current:
        batches.append(current)
    return batches


def collate(episodes: list[TokenizedEpisode], index: list[int], pad_id: int, device: str) -> MicroBatch:
    rows = [episodes[i] for i in index]
    width = max(len(e.input_ids) for e in rows)
    n = len(rows)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.float32)
    behavior = torch.zeros((n, width), dtype=torch.float32)
    has_behavior = torch.zeros(n, dtype=torch.bool)
    for b, e in enumerate(rows):
        length = len(e.input_ids)
        input_ids[b, :length] = torch.tensor(e.input_ids)
        attention[b, :length] = 1
        mask[b, :length] = torch.tensor(e.loss_mask, dtype=torch.float32)
        if e.behavior is not None:
            behavior[b, :length] = torch.tensor(e.behavior, dtype=torch.float32)
            has_behavior[b] = True
    # position t of a per-token tensor scores input_ids[:, t + 1] (predicted from the tokens up to t)
    return MicroBatch(
        index,
        input_ids.to(device),
        attention.to(device),
        mask[:, 1:].to(device),
        behavior[:, 1:].to(device),
        has_behavior.to(device),
    )


def mismatched_pairs(episodes: list[TokenizedEpisode], index: list[int]) -> list[TokenizedEpisode]:
    """Each episode's prompt with the next episode's completion (KTO's KL reference point is
    estimated on such unrelated pairs, Ethayarajh et al. 2024, section 4.1)."""
    rows = [episodes[i] for i in index]
    out = []
    for k, e in enumerate(rows):
        other = rows[(k + 1) % len(rows)]
        cut_self, cut_other = e.loss_mask.index(1), other.loss_mask.index(1)
        out.append(
            TokenizedEpisode(
                request_id=f"{e.request_id}|{other.request_id}",
                input_ids=e.input_ids[:cut_self] + other.input_ids[cut_other:],
                loss_mask=e.loss_mask[:cut_self] + other.loss_mask[cut_other:],
                behavior=None,
                behavior_note="missing",
            )
        )
    return out
