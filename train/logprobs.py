"""Log-probs of logged tokens under a model: the policy being trained, its reference (the base,
adapter off), and the behaviour log-probs recomputed for episodes logged without them.

Every one is taken under the distribution the tokens were sampled from (train/sampling.py).
"""

from __future__ import annotations

from typing import Any

import torch

from train.batches import MicroBatch, collate, pack
from train.data import TokenizedEpisode
from train.sampling import SamplingRows


def token_logprobs(model: Any, batch: MicroBatch, sampling: SamplingRows) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target token [B, T] under the distribution it was sampled from -- see
    train/sampling.py --, entropy of each position's distribution at its temperature [B, T], no grad)."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention).logits[:, :-1].float()  # [B, T, V]
    logits = logits / sampling.temperature[:, None, None]
    logp = sampling.logprobs(logits, batch.input_ids[:, 1:], batch.mask)  # [B, T]
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1)
        entropy = torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)  # [B, T]
    return logp, entropy


def reference_logprobs(model: Any, batch: MicroBatch, sampling: SamplingRows) -> torch.Tensor:
    peft = getattr(model, "module", model)  # under DistributedDataParallel: the model it wraps
    with torch.no_grad(), peft.disable_adapter():  # the base policy: the same weights, adapter off
        return token_logprobs(peft, batch, sampling)[0]


def recompute_behavior(
    model: Any, episodes: list[TokenizedEpisode], pad_id: int, batch_tokens: int, sampling: SamplingRows
) -> torch.Tensor:
    """Fill in behaviour log-probs of the episodes that have none, from `model` as it is now;
    returns them as one padded tensor [N_missing, L_max] (row k: the k-th such episode)."""
    missing = [i for i, e in enumerate(episodes) if e.behavior is None]
    device = next(model.parameters()).device.type
    width = max((len(episodes[i].input_ids) for i in missing), default=1)
    out = torch.zeros(len(missing), width)
    was_training = model.training
    model.eval()  # no dropout: these stand for what serving computed
    with torch.no_grad():
        for rows in pack([len(episodes[i].input_ids) for i in missing], batch_tokens, seed=0, epoch=0):
            index = [missing[k] for k in rows]
            batch = collate(episodes, index, pad_id, device)
            logp = token_logprobs(model, batch, sampling[torch.tensor(index, device=device)])[0] * batch.mask
            for row, k in enumerate(rows):
                out[k, 1 : logp.size(1) + 1] = logp[row].cpu()  # position t scores token t + 1
    model.train(was_training)
    set_behavior(episodes, missing, out)
    return out


def set_behavior(episodes: list[TokenizedEpisode], missing: list[int], values: torch.Tensor) -> None:
    for k, i in enumerate(missing):
        episodes[i].behavior = values[k, : len(episodes[i].input_ids)].tolist()
        episodes[i].behavior_note = "recomputed"
