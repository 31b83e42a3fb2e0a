"""LoRA adapters made for tests: a policy visibly different from its base."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.core.config import TrainConfig
from train.lora import attach_adapter, save_adapter
from train.models import load_policy


def make_adapter(base: Path, out: Path, seed: int, std: float = 0.3, r: int = 4) -> Path:
    """A LoRA adapter with random (non-zero) B matrices: a policy visibly different from the base."""
    policy = load_policy(base, device="cpu")
    torch.manual_seed(seed)
    model = attach_adapter(policy.model, TrainConfig(lora_r=r, lora_alpha=2 * r))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, std)
    return save_adapter(model, out)
