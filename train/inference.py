"""Inference on one base model with named LoRA adapters: what evaluation and serving need.

    policies = PolicySet.load(base_dir)        the base weights, once
    policies.add("7", adapter_dir)             a named adapter (a registry version)
    policies.sequence_logprobs("7", episodes)  [N] log pi(completion | prompt), at the serving temperature
    policies.compare("6", "7", episodes)       both policies' [N] log-probs and the mean KL(p_6 || p_7)
                                               per completion token, from one forward pass of each
    policies.generate("7", prompts, ...)       text, token ids, per-token log-probs (after temperature)

The name None is the base model with every adapter off. Adapters share the base weights: a
second policy costs only its LoRA matrices. Calls are not thread-safe (peft's active adapter is
module state); a server serialises them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.types import LoggedEpisode
from train.batches import collate, pack
from train.data import TokenizedEpisode, tokenize_episode
from train.lora import load_adapter
from train.loop import token_logprobs
from train.models import ModelError, Policy, load_policy, render_prompt


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # as sampled: the end-of-sequence token included when it stopped
    logprobs: list[float]  # of each sampled token, under the distribution it was sampled from
    latency_ms: float
    stopped: bool = False  # ended with the end-of-sequence token (the last of token_ids), not at the limit


class PolicySet:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.model: Any = policy.model  # becomes a PeftModel with the first adapter
        self.names: set[str] = set()

    @classmethod
    def load(cls, base: str | Path, device: str | None = None) -> "PolicySet":
        return cls(load_policy(base, device=device))

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def add(self, name: str, adapter: str | Path) -> None:
        """Load `adapter` under `name` (a ModelError names the path if it does not load)."""
        if name in self.names:
            return
        if not self.names:
            self.model = load_adapter(self.model, adapter, adapter_name=name, trainable=False)
        else:
            try:
                self.model.load_adapter(str(adapter), adapter_name=name, is_trainable=False)
            except Exception as exc:  # noqa: BLE001 - safetensors/json/shape errors
                raise ModelError(f"cannot load the adapter at {adapter}: {type(exc).__name__}: {exc}") from None
        self.names.add(name)
        self.model.eval()

    def remove(self, name: str) -> None:
        if name in self.names and len(self.names) > 1:
            self.model.delete_adapter(name)
            self.names.discard(name)

    def _use(self, name: str | None):
        """A context with `name` active (None: adapters off)."""
        if name is None:
            return self.model.disable_adapter() if self.names else _Nothing()
        if name not in self.names:
            raise ModelError(f"no adapter named {name!r} is loaded")
        self.model.set_adapter(name)
        return _Nothing()

    def _tokenize(self, episodes: list[Any]) -> list[TokenizedEpisode | None]:
        """None for an episode without assistant tokens, or whose logged behaviour log-probs do
        not line up with its tokens (its sequence log-prob would not be comparable)."""
        out = []
        for e in episodes:
            t = tokenize_episode(self.tokenizer, e.request_id, e.prompt, e.completion, e.completion_token_ids)
            behavior = getattr(e, "behavior_logprobs", None)
            if isinstance(t, TokenizedEpisode) and (behavior is None or len(behavior) == sum(t.loss_mask)):
                t.temperature = e.temperature
                out.append(t)
            else:
                out.append(None)
        return out

    @torch.no_grad()
    def _per_token(self, name: str | None, episodes: list[TokenizedEpisode], fn) -> list[Any]:
        results: list[Any] = [None] * len(episodes)
        pad = self.tokenizer.pad_token_id
        with self._use(name):
            for index in pack([len(e.input_ids) for e in episodes], 8192, seed=0, epoch=0):
                batch = collate(episodes, index, pad, self.policy.device)
                temp = torch.tensor([episodes[i].temperature for i in index], device=self.policy.device)
                for row, value in zip(index, fn(batch, temp)):
                    results[row] = value
        return results

    def sequence_logprobs(self, name: str | None, episodes: list[LoggedEpisode]) -> list[float | None]:
        """Sum of the completion's (assistant) token log-probs; None where an episode has none."""
        toks = self._tokenize(episodes)
        kept = [t for t in toks if t is not None]
        sums = self._per_token(name, kept, lambda b, temp: (token_logprobs(self.model, b, temp)[0] * b.mask)
                               .sum(-1).tolist())
        it = iter(sums)
        return [next(it) if t is not None else None for t in toks]

    @torch.no_grad()
    def compare(self, p: str | None, q: str | None,
                episodes: list[LoggedEpisode]) -> tuple[list[float | None], list[float | None], float]:
        """`sequence_logprobs` of `p` and of `q`, and the mean over completion tokens of KL(p || q)
        between their next-token distributions, from one forward pass of each (what the gate needs)."""
        if p == q:
            raise ValueError(f"compare needs two different policies, got {p!r} twice")
        toks = self._tokenize(episodes)
        kept = [t for t in toks if t is not None]
        seq = {p: [0.0] * len(kept), q: [0.0] * len(kept)}
        total, tokens = 0.0, 0.0
        for index in pack([len(e.input_ids) for e in kept], 8192, seed=0, epoch=0):
            batch = collate(kept, index, self.tokenizer.pad_token_id, self.policy.device)
            temp = torch.tensor([kept[i].temperature for i in index], device=self.policy.device)[:, None, None]
            targets = batch.input_ids[:, 1:].unsqueeze(-1)  # [B, T, 1]
            logp = {}
            for name in (p, q):
                with self._use(name):
                    logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention).logits
                logp[name] = torch.log_softmax(logits[:, :-1].float() / temp, -1)  # [B, T, V]
                sums = (logp[name].gather(-1, targets).squeeze(-1) * batch.mask).sum(-1)  # [B]
                for row, value in zip(index, sums.tolist()):
                    seq[name][row] = value
            kl = (logp[p].exp() * (logp[p] - logp[q])).sum(-1)  # [B, T]
            total += float((kl * batch.mask).sum())
            tokens += float(batch.mask.sum())
        out = {}
        for name in (p, q):
            it = iter(seq[name])
            out[name] = [next(it) if t is not None else None for t in toks]
        return out[p], out[q], total / max(tokens, 1.0)

    @torch.no_grad()
    def generate(self, name: str | None, prompts: list[Any], max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None, batch_size: int = 1) -> list[Generation]:
        """One completion per prompt; temperature 0 is greedy (log-probs then at temperature 1).
        `batch_size` > 1 generates left-padded batches (evaluation); latency is then the batch's
        time per prompt. Serving uses 1: exact per-request latency, no padding effects."""
        out: list[Generation] = []
        with self._use(name):
            for i in range(0, len(prompts), batch_size):
                if seed is not None:
                    torch.manual_seed(seed)
                out += self._generate_batch(prompts[i:i + batch_size], max_new_tokens, temperature, top_p)
        return out

    def _generate_batch(self, prompts: list[Any], max_new_tokens: int, temperature: float,
                        top_p: float) -> list[Generation]:
        tok = self.tokenizer
        t0 = time.perf_counter()
        rows = [tok(render_prompt(tok, p), add_special_tokens=False).input_ids for p in prompts]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, device=self.policy.device)  # [B, L], left-padded
        attention = torch.zeros_like(ids)
        for b, r in enumerate(rows):
            ids[b, width - len(r):] = torch.tensor(r)
            attention[b, width - len(r):] = 1
        sample = temperature > 0
        gen = self.model.generate(
            input_ids=ids, attention_mask=attention, max_new_tokens=max_new_tokens, do_sample=sample,
            temperature=temperature if sample else None, top_p=top_p if sample else None, top_k=None,
            output_scores=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
        new = gen.sequences[:, width:]  # [B, n]
        # scores are the logits after temperature/top-p: the distribution each token came from
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in gen.scores], 1)  # [B, n, V]
        chosen = logp.gather(-1, new[:, :logp.size(1), None]).squeeze(-1)  # [B, n]
        latency = (time.perf_counter() - t0) * 1000 / len(rows)
        out = []
        for b in range(len(rows)):
            ids_out, logprobs = new[b].tolist(), chosen[b].tolist()
            stopped = tok.eos_token_id in ids_out
            if stopped:
                # the end-of-sequence token is an action the policy took (stopping here): it stays
                # in the ids and log-probs (as vLLM reports them), so training and the gate's
                # importance ratios see it; only the text leaves it out
                cut = ids_out.index(tok.eos_token_id) + 1
                ids_out, logprobs = ids_out[:cut], logprobs[:cut]
            text = tok.decode(ids_out[:-1] if stopped else ids_out)
            out.append(Generation(text, ids_out, logprobs, latency, stopped))
        return out


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
