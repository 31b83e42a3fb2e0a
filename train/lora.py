"""LoRA adapters (Hu et al., arXiv:2106.09685) on a loaded policy, via peft.

    attach_adapter(model, cfg)                 a fresh trainable adapter, targets per architecture
    load_adapter(model, path)                  continue a saved adapter (the champion's) trainably
    save_adapter(model, out)                   adapter_model.safetensors + adapter_config.json
    resident_base(path) / release(model)       one base kept loaded between a process's training
                                               runs (the daemon's cycles); release strips the
                                               run's adapter off it again

Targets: the attention and MLP projections of the architectures we know (adapting the MLP as
well as attention is what makes LoRA match full fine-tuning, Biderman et al. arXiv:2405.09673),
peft's own table next, and every linear layer as the last resort. `lora_target_modules`
overrides all of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.core.config import TrainConfig
from train.models import ModelError, Policy, load_policy

_PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS_BY_ARCH: dict[str, list[str]] = {
    "llama": _PROJ,
    "mistral": _PROJ,
    "qwen2": _PROJ,
    "qwen3": _PROJ,
    "gemma": _PROJ,
    "gemma2": _PROJ,
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
}


def target_modules(model: Any, cfg: TrainConfig) -> list[str] | str:
    if cfg.lora_target_modules:
        return list(cfg.lora_target_modules)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_TARGETS

    arch = model.config.model_type
    return TARGETS_BY_ARCH.get(arch) or PEFT_TARGETS.get(arch) or "all-linear"


def attach_adapter(model: Any, cfg: TrainConfig) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=target_modules(model, cfg),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except ValueError as exc:  # peft names the modules it could not find
        raise ModelError(
            f"cannot attach LoRA to {model.config.model_type}: {exc}; "
            "set train.lora_target_modules to the model's projection names"
        ) from None


def load_adapter(model: Any, path: str | Path, adapter_name: str = "default", trainable: bool = True) -> Any:
    """Load a saved adapter on top of `model`; trainable by default: the candidate continues the champion."""
    from peft import PeftModel

    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise ModelError(f"no adapter at {path}: expected adapter_config.json and adapter_model.safetensors")
    try:
        return PeftModel.from_pretrained(model, path, adapter_name=adapter_name, is_trainable=trainable)
    except Exception as exc:  # noqa: BLE001 - a corrupt file raises safetensors, json or shape errors
        raise ModelError(f"cannot load the adapter at {path}: {type(exc).__name__}: {exc}") from None


def save_adapter(model: Any, out: str | Path) -> Path:
    out = Path(out)
    model.save_pretrained(out, safe_serialization=True)
    return out


# path -> (what its files looked like when loaded, the policy): one base at a time
_RESIDENT: dict[str, tuple[tuple, Policy]] = {}


def _files_stamp(path: Path) -> tuple:
    """Names, sizes and modification times of a model directory's files: a base rebuilt in
    place (same config, new weights) is loaded again."""
    return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir() if f.is_file()))


def set_gradient_checkpointing(model: Any, on: bool) -> None:
    """Recompute activations in the backward pass (non-reentrant: LoRA's frozen inputs need no
    grad-enabling hook), or stop doing so."""
    inner = getattr(getattr(model, "base_model", model), "model", model)  # PeftModel -> LoraModel -> the LM
    if on:
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif getattr(inner, "is_gradient_checkpointing", False):
        inner.gradient_checkpointing_disable()


def resident_base(path: str | Path, device: str | None = None) -> Policy:
    """load_policy(path), kept loaded for the next training run of this process: a daemon trains
    from the same base every cycle, and loading it is the whole model read from disk (seconds to
    minutes on a large base). Each run attaches its adapter in place and must `release` it."""
    path = Path(path)
    key, stamp = str(path.resolve()), _files_stamp(path) if path.is_dir() else ()
    held = _RESIDENT.get(key)
    # reused only as loaded: a run that died before its release() left its adapter attached
    if (
        held is not None
        and held[0] == stamp
        and not hasattr(held[1].model, "peft_config")
        and device in (None, held[1].device)
    ):
        return held[1]
    _RESIDENT.clear()  # never two bases in memory
    policy = load_policy(path, device=device)
    _RESIDENT[key] = (stamp, policy)
    return policy


def release(model: Any) -> None:
    """Take a run's LoRA adapter off its resident base (peft's unload: the base's own modules back
    in place, their weights untouched -- LoRA trains only the adapter). A base that cannot be
    restored is forgotten, and the next run loads it afresh."""
    try:
        set_gradient_checkpointing(model, False)
        model.unload()
    except Exception:  # noqa: BLE001 - whatever went wrong, that base is not to be reused
        _RESIDENT.clear()
