"""Log-probs of served tokens under the distribution they were sampled from.

A server samples token x_t from the model's logits z_t after its sampling settings: divided by
the temperature T, then cut to the top k logits, then to the nucleus -- the smallest set of the
most likely tokens whose probability reaches top_p -- and renormalised over what is left, K_t:

    log pi(x_t) = z_t[x_t] / T - logsumexp_{v in K_t} z_t[v] / T

(transformers' TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper, and vLLM's
sampler, in that order). The behaviour log-probs a server reports are these; training's
importance ratio and the gate's estimate must compare against the same quantity, or every
token of a top-p request looks off-policy by log(1 / P(K_t)) (up to ~0.1 nats at top_p 0.9).

K_t is chosen without gradient (it is a set); the log-prob is differentiable in the logits of
K_t. The served token is always kept in K_t: it was drawn from it, and a recomputation that
differs in the last bits must not give it probability zero.

Memory: finding K_t sorts the logits of each position. Only the positions that carry loss are
sorted, a chunk of rows at a time, so the cost is a bounded multiple of one chunk, not of the
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SORT_ELEMENTS = 1 << 24  # logits sorted at once: [rows, V] with rows = this // V


def kept_threshold(logits: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[M, V] logits (after temperature), [M] top_p in (0, 1], [M] top_k (<= 0: off) -> [M] the
    smallest logit that survives top-k then top-p; every logit >= it is in K."""
    m, vocab = logits.shape
    out = torch.empty(m, dtype=logits.dtype, device=logits.device)
    step = max(1, _SORT_ELEMENTS // vocab)
    arange = torch.arange(vocab, device=logits.device)
    with torch.no_grad():
        for s in range(0, m, step):
            rows = slice(s, min(s + step, m))
            ordered = logits[rows].sort(dim=-1).values  # [r, V] ascending
            k = top_k[rows]
            first_k = torch.where(k > 0, vocab - k.clamp(max=vocab), torch.zeros_like(k))  # [r] first kept by top-k
            cut = ordered.masked_fill(arange[None, :] < first_k[:, None], float("-inf"))
            cumulative = cut.softmax(-1).cumsum(-1)  # [r, V]
            # transformers: remove where cumulative <= 1 - top_p (a prefix, ascending), keep >= 1
            removed = (cumulative <= (1 - top_p[rows])[:, None]).sum(-1).clamp(max=vocab - 1)  # [r]
            first = torch.maximum(removed, first_k)
            out[rows] = ordered.gather(-1, first[:, None]).squeeze(-1)
    return out


def sampled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor
) -> torch.Tensor:
    """[M, V] logits after temperature, [M] served token ids, [M] top_p, [M] top_k -> [M]
    log pi(target) under the truncated, renormalised distribution (differentiable)."""
    chosen = logits.gather(-1, targets[:, None]).squeeze(-1)  # [M]
    if not bool(((top_p < 1) | (top_k > 0)).any()):
        return chosen - torch.logsumexp(logits, dim=-1)
    threshold = kept_threshold(logits.detach(), top_p, top_k)  # [M]
    kept = logits.detach() >= threshold[:, None]
    kept.scatter_(-1, targets[:, None], True)  # the served token was in K
    return chosen - torch.logsumexp(logits.masked_fill(~kept, float("-inf")), dim=-1)


@dataclass(frozen=True)
class SamplingRows:
    """The sampling settings of a set of episodes, as tensors on the device ([N] each); indexing
    with a tensor of episode indices gives those episodes' settings."""

    temperature: torch.Tensor  # float
    top_p: torch.Tensor  # float, 1.0: off
    top_k: torch.Tensor  # long, 0: off

    @classmethod
    def of(cls, episodes: list, device: str | torch.device = "cpu") -> SamplingRows:
        """From episodes that have .temperature, .top_p, .top_k (TokenizedEpisode, LoggedEpisode)."""
        return cls(
            torch.tensor([e.temperature for e in episodes], dtype=torch.float32, device=device),
            torch.tensor([e.top_p for e in episodes], dtype=torch.float32, device=device),
            torch.tensor([e.top_k for e in episodes], dtype=torch.long, device=device),
        )

    def __getitem__(self, index: torch.Tensor) -> SamplingRows:
        return SamplingRows(self.temperature[index], self.top_p[index], self.top_k[index])

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """[B, T, V] logits already divided by the temperature, [B, T] targets and loss mask ->
        [B, T] log-probs of the targets as they were sampled: truncated (top-p/top-k) where they
        carry loss and the episode was sampled so, temperature-only elsewhere."""
        # gather minus logsumexp: never materialises a second [B, T, V] tensor of log-probs
        logp = logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, T]
        cut = ((self.top_p < 1) | (self.top_k > 0))[:, None] & mask.bool()  # [B, T]
        if bool(cut.any()):
            rows = cut.nonzero(as_tuple=True)
            exact = sampled_logprobs(logits[rows], targets[rows], self.top_p[rows[0]], self.top_k[rows[0]])  # [M]
            logp = logp.index_put(rows, exact)
        return logp
