"""A training configuration small enough for the tests, and episodes tokenized for it."""

from __future__ import annotations

from pipeline.core.config import TrainConfig
from train.data import tokenize_episode

CFG = TrainConfig(learning_rate=5e-3, epochs=8, batch_tokens=1024, max_seq_len=64, lora_r=8, lora_alpha=16)


def tokenized(tokenizer, episodes, drop_behavior_every: int = 0):
    out = []
    for i, e in enumerate(episodes):
        behavior = None if drop_behavior_every and i % drop_behavior_every == 0 else e["behavior_logprobs"]
        out.append(
            tokenize_episode(tokenizer, str(i), e["prompt"], e["completion"], e["completion_token_ids"], behavior)
        )
    return out
