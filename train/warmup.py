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


def warm_up(model_dir: Path, sample: Callable[[random.Random], tuple[str, str]], steps: int = 300,
            batch: int = 64, lr: float = 3e-3, seed: int = 0) -> Path:
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
        width = max(len(r) for r in rows)
        ids = torch.full((batch, width), tok.pad_token_id)  # [B, L]
        mask = torch.zeros(batch, width)
        attention = torch.zeros(batch, width, dtype=torch.long)
        for i, (r, m) in enumerate(zip(rows, masks)):
            ids[i, :len(r)], mask[i, :len(m)], attention[i, :len(r)] = torch.tensor(r), torch.tensor(m), 1
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]  # [B, L-1, V]
        loss_tok = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
        loss = (loss_tok * mask[:, 1:]).sum() / mask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)
    return model_dir
