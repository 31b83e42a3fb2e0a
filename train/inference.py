"""Inference on one base model with named LoRA adapters: what evaluation and serving need.

    policies = PolicySet.load(base_dir)        the base weights, once
    policies.add("7", adapter_dir)             a named adapter (a registry version)
    policies.sequence_logprobs("7", episodes)  [N] log pi(completion | prompt), at the serving temperature
    policies.compare("6", "7", episodes)       both policies' [N] log-probs and the mean KL(p_6 || p_7)
                                               per completion token, from one forward pass of each
                                               (remembered: an episode seen before is not run again),
                                               batch by batch: memory is set by LOGITS_ELEMENTS and
                                               MEMO_BYTES, not by the number of episodes
    policies.generate("7", prompts, ...)       text, token ids, per-token log-probs (after temperature)

The name None is the base model with every adapter off. Adapters share the base weights: a
second policy costs only its LoRA matrices. Calls are not thread-safe (peft's active adapter is
module state); a server serialises them.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList, TemperatureLogitsWarper, TopPLogitsWarper

from pipeline.core.chat import render_prompt
from pipeline.core.types import LoggedEpisode
from train.batches import collate, pack_by_length
from train.data import TokenizedEpisode, tokenize_episode
from train.logprobs import token_logprobs
from train.lora import load_adapter
from train.models import ModelError, Policy, load_policy
from train.sampling import SamplingRows
from train.streaming import StepLogprobs, Stopped, TokenStream


@dataclass
class Generation:
    text: str
    token_ids: list[int]  # as sampled: the end-of-sequence token included when it stopped
    logprobs: list[float]  # of each sampled token, under the distribution it was sampled from
    latency_ms: float
    stopped: bool = False  # ended with the end-of-sequence token (the last of token_ids), not at the limit


class PolicySet:
    # what compare() may keep of the policies' distributions: 0.8 MB for the demo's 400 held-out
    # episodes; at a large vocabulary and long completions it holds fewer and recomputes the rest
    MEMO_BYTES = 256 << 20
    # what one batch's [B, T, V] logits may hold (128 MB in float32): 1024 tokens at a 32k
    # vocabulary, 220 at Qwen's 152k. Every [.., V] tensor is reduced to per-token scalars
    # before the next batch, so a forward pass costs a few of these whatever the episode count
    LOGITS_ELEMENTS = 1 << 25

    def _batch_tokens(self) -> int:
        return max(64, self.LOGITS_ELEMENTS // self.policy.model.config.vocab_size)

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.model: Any = policy.model  # becomes a PeftModel with the first adapter
        self.names: set[str] = set()
        # (policy, request id, temperature, tokens) -> what compare() computed; greedy outputs
        # (policy, prompt, max_new_tokens) -> Generation, for generate(..., reuse=True)
        self._memo: OrderedDict[tuple, Any] = OrderedDict()
        self._memo_bytes = 0
        self._greedy: dict[tuple, Generation] = {}

    @classmethod
    def load(cls, base: str | Path, device: str | None = None) -> PolicySet:
        return cls(load_policy(base, device=device))

    @property
    def tokenizer(self) -> Any:
        return self.policy.tokenizer

    def prompt_tokens(self, prompt: Any, tools: list[dict] | None = None) -> int | None:
        """How many tokens `prompt` is for this model; None if it cannot be rendered (a chat
        template may refuse its roles)."""
        try:
            return len(self.tokenizer(render_prompt(self.tokenizer, prompt, tools), add_special_tokens=False).input_ids)
        except Exception:  # noqa: BLE001 - whatever the template or the tokenizer raises
            return None

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
            self.names.discard(name)
            self.model.set_adapter(next(iter(self.names)))  # peft warns when the active adapter goes
            self.model.delete_adapter(name)
            for key in [k for k in self._memo if k[0] == name]:
                self._forget(key)
            self._greedy = {k: v for k, v in self._greedy.items() if k[0] != name}

    def _use(self, name: str | None):
        """A context with `name` active (None: adapters off)."""
        if name is None:
            return self.model.disable_adapter() if self.names else _Nothing()
        if name not in self.names:
            raise ModelError(f"no adapter named {name!r} is loaded")
        self.model.set_adapter(name)
        return _Nothing()

    def _tokenize(self, episodes: list[Any], max_tokens: int | None = None) -> list[TokenizedEpisode | None]:
        """None for an episode that cannot be used (tokenize_episode's skips: no assistant token,
        served ids outside the vocabulary, a prompt the template refuses), is longer than
        `max_tokens`, or whose logged behaviour log-probs do not line up with its tokens (its
        sequence log-prob would not be comparable)."""
        out = []
        for e in episodes:
            t = tokenize_episode(
                self.tokenizer,
                e.request_id,
                e.prompt,
                e.completion,
                e.completion_token_ids,
                tools=getattr(e, "tools", None),
            )
            behavior = getattr(e, "behavior_logprobs", None)
            if (
                isinstance(t, TokenizedEpisode)
                and (max_tokens is None or len(t.input_ids) <= max_tokens)
                and (behavior is None or len(behavior) == sum(t.loss_mask))
            ):
                t.sample_with(e)
                out.append(t)
            else:
                out.append(None)
        return out

    @torch.no_grad()
    def _per_token(self, name: str | None, episodes: list[TokenizedEpisode], fn) -> list[Any]:
        results: list[Any] = [None] * len(episodes)
        pad = self.tokenizer.pad_token_id
        with self._use(name):
            for index in pack_by_length([len(e.input_ids) for e in episodes], self._batch_tokens()):
                batch = collate(episodes, index, pad, self.policy.device)
                sampling = SamplingRows.of([episodes[i] for i in index], self.policy.device)
                for row, value in zip(index, fn(batch, sampling)):
                    results[row] = value
        return results

    def sequence_logprobs(self, name: str | None, episodes: list[LoggedEpisode]) -> list[float | None]:
        """Sum of the completion's (assistant) token log-probs; None where an episode has none."""
        toks = self._tokenize(episodes)
        kept = [t for t in toks if t is not None]
        sums = self._per_token(
            name, kept, lambda b, sampling: (token_logprobs(self.model, b, sampling)[0] * b.mask).sum(-1).tolist()
        )
        it = iter(sums)
        return [next(it) if t is not None else None for t in toks]

    @torch.no_grad()
    def compare(
        self, p: str | None, q: str | None, episodes: list[LoggedEpisode], max_tokens: int | None = None
    ) -> tuple[list[float | None], list[float | None], float]:
        """`sequence_logprobs` of `p` and of `q`, and the mean over completion tokens of KL(p || q)
        between their next-token distributions (what the gate needs). Each policy's distributions
        on an episode are remembered (see MEMO_BYTES): the champion, gated against one candidate
        after another on a held-out window that slides a little each cycle, is run only on the
        episodes it has not seen. Episodes it cannot use (see _tokenize) get None."""
        if p == q:
            raise ValueError(f"compare needs two different policies, got {p!r} twice")
        toks = self._tokenize(episodes, max_tokens)
        kept = [t for t in toks if t is not None]
        seqs: dict[str | None, list[float]] = {p: [0.0] * len(kept), q: [0.0] * len(kept)}
        total, tokens = 0.0, 0
        # a batch at a time: both policies' [n, V] distributions of a batch's episodes are
        # reduced to sequence log-probs and a KL sum before the next batch is run
        for chunk in pack_by_length([len(t.input_ids) for t in kept], self._batch_tokens()):
            part = [kept[i] for i in chunk]
            for i, (seq_p, logp_p), (seq_q, logp_q) in zip(
                chunk, self._completion_logprobs(p, part), self._completion_logprobs(q, part)
            ):
                seqs[p][i], seqs[q][i] = seq_p, seq_q
                total += float((logp_p.exp() * (logp_p - logp_q)).sum())  # summed over its n tokens
                tokens += logp_p.size(0)
        out = {}
        for name in (p, q):
            it = iter(seqs[name])
            out[name] = [next(it) if t is not None else None for t in toks]
        return out[p], out[q], total / max(tokens, 1)

    def _completion_logprobs(self, name: str | None, episodes: list[TokenizedEpisode]) -> list[tuple[float, Any]]:
        """Per episode: the completion's log-prob under `name` (as it was sampled: temperature,
        top-k, top-p), and its log-distributions at the completion's positions ([n, V], at the
        episode's temperature, for the KL); remembered per policy."""
        keys = [(name, e.request_id, e.temperature, e.top_p, e.top_k, hash(tuple(e.input_ids))) for e in episodes]
        out: list[Any] = [self._memo.get(k) for k in keys]
        missing = [i for i, v in enumerate(out) if v is None]
        pad = self.tokenizer.pad_token_id
        with self._use(name):
            for index in pack_by_length([len(episodes[i].input_ids) for i in missing], self._batch_tokens()):
                rows = [missing[j] for j in index]
                batch = collate(episodes, rows, pad, self.policy.device)
                sampling = SamplingRows.of([episodes[i] for i in rows], self.policy.device)
                logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention).logits
                logits = logits[:, :-1].float() / sampling.temperature[:, None, None]  # [B, T, V]
                seqs = (sampling.logprobs(logits, batch.input_ids[:, 1:], batch.mask) * batch.mask).sum(-1)  # [B]
                logp = torch.log_softmax(logits, -1)  # [B, T, V]
                for b, (i, seq) in enumerate(zip(rows, seqs.tolist())):
                    out[i] = (seq, logp[b][batch.mask[b].bool()].cpu())  # [n, V]
                    self._remember(keys[i], out[i])
        return out

    def _remember(self, key: tuple, value: tuple[float, Any]) -> None:
        self._memo[key] = value
        self._memo_bytes += value[1].nbytes
        while self._memo_bytes > self.MEMO_BYTES and len(self._memo) > 1:
            self._forget(next(iter(self._memo)))  # the oldest first

    def _forget(self, key: tuple) -> None:
        self._memo_bytes -= self._memo.pop(key)[1].nbytes

    @torch.no_grad()
    def generate(
        self,
        name: str | None,
        prompts: list[Any],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        batch_size: int = 1,
        reuse: bool = False,
        tools: list[dict] | None = None,
        on_token: Callable[[int, float], None] | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        """One completion per prompt; temperature 0 is greedy (log-probs then at temperature 1).
        `batch_size` > 1 generates left-padded batches (evaluation); latency is then the batch's
        time per prompt. Serving uses 1: exact per-request latency, no padding effects.
        `reuse` (greedy only): a prompt this policy already answered at this length is not
        generated again (the same output; its latency is the first time's). `tools`: offered
        with every prompt (rendered by the chat template). Streaming (one prompt): `on_token(id,
        log-prob)` is called for each token as it is sampled, and generation ends early once
        `stop` is set (a client that went away)."""
        if (on_token is not None or stop is not None) and (len(prompts) != 1 or reuse):
            raise ValueError("streaming generates one prompt, never reused")
        keys = [(name, orjson.dumps([p, tools], option=orjson.OPT_SORT_KEYS), max_new_tokens) for p in prompts]
        done = [self._greedy.get(k) if reuse and temperature == 0 else None for k in keys]
        todo = [i for i, g in enumerate(done) if g is None]
        fresh: list[Generation] = []
        with self._use(name):
            for i in range(0, len(todo), batch_size):
                if seed is not None:
                    torch.manual_seed(seed + i)  # each batch its own draws, the same for any policy
                fresh += self._generate_batch(
                    [prompts[j] for j in todo[i : i + batch_size]],
                    max_new_tokens,
                    temperature,
                    top_p,
                    tools,
                    on_token,
                    stop,
                )
        for i, g in zip(todo, fresh):
            done[i] = g
            if reuse and temperature == 0:
                self._greedy[keys[i]] = g
        while len(self._greedy) > 50_000:  # a bound: the oldest go first
            del self._greedy[next(iter(self._greedy))]
        return done

    def _generate_batch(
        self,
        prompts: list[Any],
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        tools: list[dict] | None = None,
        on_token: Callable[[int, float], None] | None = None,
        stop: threading.Event | None = None,
    ) -> list[Generation]:
        tok = self.tokenizer
        t0 = time.perf_counter()
        rows = [tok(render_prompt(tok, p, tools), add_special_tokens=False).input_ids for p in prompts]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), tok.pad_token_id, device=self.policy.device)  # [B, L], left-padded
        attention = torch.zeros_like(ids)
        for b, r in enumerate(rows):
            ids[b, width - len(r) :] = torch.tensor(r)
            attention[b, width - len(r) :] = 1
        sample = temperature > 0
        # the sampling distribution built here, not by generate() from temperature/top_p: a
        # caller's processors run before generate()'s own warpers, and the streaming recorder
        # must see each step's distribution after them, as output_scores does
        processors = LogitsProcessorList()
        if sample and temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if sample and top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        streaming: dict[str, Any] = {}
        if on_token is not None or stop is not None:
            step = StepLogprobs()
            processors.append(step)
            streaming = {
                "streamer": TokenStream(step, on_token),
                "stopping_criteria": StoppingCriteriaList([Stopped(stop or threading.Event())]),
            }
        gen = self.model.generate(
            input_ids=ids,
            attention_mask=attention,
            max_new_tokens=max_new_tokens,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_p=1.0 if sample else None,
            top_k=None,
            logits_processor=processors,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
            **streaming,
        )
        new = gen.sequences[:, width:]  # [B, n]
        # scores are the logits after temperature/top-p: the distribution each token came from
        logp = torch.stack([torch.log_softmax(s.float(), -1) for s in gen.scores], 1)  # [B, n, V]
        chosen = logp.gather(-1, new[:, : logp.size(1), None]).squeeze(-1)  # [B, n]
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
