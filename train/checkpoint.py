"""Checkpoints as safetensors: the adapter, the optimizer's state and the RNG state.

    <dir>/adapter/            peft's adapter_model.safetensors + adapter_config.json
    <dir>/trainer.safetensors AdamW moments and step per parameter, the torch RNG state(s), the
                              behaviour log-probs recomputed at the run's start; its metadata
                              holds the optimizer's param groups and the step

Restoring all three makes "train 2 steps, save, load, train 2 more" produce the same adapter
as "train 4 steps" (tests/unit/test_train_loop.py): the data order is a function of the seed and the
step, dropout draws come from the restored RNG.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from train.lora import save_adapter
from train.models import ModelError


def save_checkpoint(
    out: Path, model: Any, optimizer: torch.optim.Optimizer, step: int, extra: dict[str, torch.Tensor] | None = None
) -> Path:
    """`extra`: tensors the loop derived at its start and must not derive again on resume."""
    out.mkdir(parents=True, exist_ok=True)
    save_adapter(model, out / "adapter")
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
    tensors.update({f"extra.{k}": v.detach().cpu().contiguous() for k, v in (extra or {}).items()})
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    for index, values in state["state"].items():
        for key, value in values.items():
            tensors[f"state.{index}.{key}"] = torch.as_tensor(value).detach().cpu().contiguous()
    meta = {"step": str(step), "param_groups": json.dumps(state["param_groups"])}
    save_file(tensors, str(out / "trainer.safetensors"), metadata=meta)
    return out


def load_checkpoint(path: Path, optimizer: torch.optim.Optimizer) -> tuple[int, dict[str, torch.Tensor]]:
    """Restore the optimizer and RNG from `path` (the adapter is loaded with the model);
    returns the step the checkpoint was taken after and the loop's extra tensors."""
    from safetensors import safe_open

    file = path / "trainer.safetensors"
    if not file.is_file():
        raise ModelError(f"no checkpoint at {path}: expected trainer.safetensors (and adapter/)")
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(file))
    torch.set_rng_state(tensors.pop("rng.cpu"))
    cuda_rng = tensors.pop("rng.cuda", None)
    if cuda_rng is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_rng)
    extra = {k[len("extra.") :]: tensors.pop(k) for k in list(tensors) if k.startswith("extra.")}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        _, index, key = name.split(".", 2)
        state.setdefault(int(index), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": json.loads(meta["param_groups"])})
    return int(meta["step"]), extra
