"""A short supervised pass: teach a freshly initialised model the format of a task (for the demo's
base policy, which must start mediocre, not hopeless).

    loss = cross-entropy on the answer tokens (and the end-of-sequence token) only   [B, A]

Full fine-tuning (not LoRA): this makes the *base* model; the loop's LoRA updates come later.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch

from train.models import load_policy


def warm_up(
    model_dir: Path,
    sample: Callable[[random.Random], tuple[str, str]],
    steps: int = 300,
    batch: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    max_tokens: int = 2048,
) -> Path:
    """Train the model at `model_dir` in place on (prompt, answer) pairs drawn by `sample`."""
    policy = load_policy(model_dir, device="cpu")
    model, tok = policy.model, policy.tokenizer
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        rows, masks = [], []
        for _ in range(batch):
            prompt, answer = sample(rng)
            p = tok(prompt, add_special_tokens=False).input_ids
            a = tok(answer, add_special_tokens=False).input_ids + [tok.eos_token_id]
            rows.append(p + a)
            masks.append([0] * len(p) + [1] * len(a))
        # rows sorted by length into chunks of at most ~max_tokens padded tokens: a few long rows
        # (a tool call among short answers) no longer pad the whole batch to their length
        order = sorted(range(batch), key=lambda i: len(rows[i]))
        chunks, chunk = [], []
        for i in order:
            if chunk and len(rows[i]) * (len(chunk) + 1) > max_tokens:
                chunks.append(chunk)
                chunk = []
            chunk.append(i)
        chunks.append(chunk)
        answer_tokens = sum(sum(m[1:]) for m in masks)
        opt.zero_grad()
        for chunk in chunks:
            width = max(len(rows[i]) for i in chunk)
            ids = torch.full((len(chunk), width), tok.pad_token_id)  # [b, L]
            mask = torch.zeros(len(chunk), width)
            attention = torch.zeros(len(chunk), width, dtype=torch.long)
            for j, i in enumerate(chunk):
                r, m = rows[i], masks[i]
                ids[j, : len(r)], mask[j, : len(m)], attention[j, : len(r)] = torch.tensor(r), torch.tensor(m), 1
            logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # [b, L-1, V]
            loss_tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            # the batch's mean over its answer tokens, summed over the chunks
            ((loss_tok * mask[:, 1:]).sum() / answer_tokens).backward()
        opt.step()
    model.save_pretrained(model_dir)
    return model_dir
