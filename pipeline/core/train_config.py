"""The `[train]` section: one LoRA training run (what it trains on, how, where, in how many
processes). Split from pipeline/core/config.py, which assembles every section."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.core.config_section import Section as _Section

LossName = Literal["cispo", "grpo", "dr_grpo", "dapo", "kto"]


class TrainConfig(_Section):
    """One LoRA training run. Defaults suit a small model on one device."""

    base_model: Path | None = Field(default=None, description="local Hugging Face model directory")
    loss: LossName = Field(default="cispo", description="the policy loss (train/losses.py's table)")
    advantage: Literal["auto", "group", "batch"] = Field(
        default="auto",
        description="group-relative where a task (a chat prompt's first user message) was answered several times, "
        "batch-relative otherwise",
    )
    learning_rate: float = Field(default=1e-4, gt=0, le=1.0, description="AdamW's, on the LoRA weights")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW's")
    epochs: int = Field(default=1, ge=1, le=1000, description="passes over the selected episodes")
    max_steps: int | None = Field(default=None, ge=1, description="optimizer steps; default: all epochs")
    batch_tokens: int = Field(default=8192, ge=16, description="token budget of one micro-batch (padded)")
    group_by_length: bool = Field(
        default=True,
        description="fill each micro-batch with episodes of similar lengths (shuffled within windows "
        "of 8 micro-batches): less padding where short and long episodes mix",
    )
    grad_accum: int = Field(default=1, ge=1, le=1024, description="micro-batches per optimizer step (per process)")
    nproc: int = Field(
        default=1,
        ge=1,
        le=64,
        description="data-parallel training processes (torch.distributed.run; NCCL on GPUs, gloo on CPUs): a step "
        "is grad_accum micro-batches in each",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        default="ddp",
        description=(
            "with nproc > 1: ddp keeps a whole base model in every process; fsdp (FSDP2) splits the frozen "
            "base model's weights over the processes (each holds 1/nproc) and keeps the LoRA weights whole, "
            "for a base too large for one device"
        ),
    )
    ddp_timeout_s: float = Field(
        default=300.0, gt=0, description="a rank stuck this long in a collective fails the run"
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto",
        description="where training, the gate and the judge run (auto: CUDA when there is one); "
        "bf16 weights where the device supports them, float32 LoRA parameters",
    )
    gradient_checkpointing: bool = Field(
        default=False, description="recompute activations in the backward pass: less memory, ~30 % more compute"
    )

    @property
    def torch_device(self) -> str | None:
        """`device` as the model loaders take it (None: CUDA when there is one)."""
        return None if self.device == "auto" else self.device

    max_grad_norm: float | None = Field(default=1.0, gt=0, description="gradient clipping (unset: none)")
    max_seq_len: int = Field(default=2048, ge=8, description="longer episodes are skipped and counted")
    seed: int = Field(default=0, description="shuffling and LoRA initialisation")
    keep_base_loaded: bool = Field(
        default=True,
        description="keep the base model in memory between one process's training runs (the daemon's "
        "cycles); off if the device cannot hold it next to the gate's copy",
    )
    cpu_threads: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="torch threads for training and the gate's evaluation on the CPU; default: one per core. Set 1 "
        "when serving or other processes share the cores: a small model's steps wait on the busy ones",
    )
    # data selection
    max_episodes: int | None = Field(default=20_000, ge=1, description="most rewarded episodes one run trains on")
    staleness_s: float | None = Field(
        default=7 * 86400, gt=0, description="episodes served longer ago than this are excluded (counted)"
    )
    tenant: str | None = Field(default=None, description="train on one tenant's episodes only (unset: all)")
    holdout_percent: float = Field(
        default=10.0,
        ge=0,
        lt=100,
        description="share of tasks (by a hash of the first user message) whose episodes "
        "never train: the gate's eval set",
    )
    # LoRA (peft)
    lora_r: int = Field(default=16, ge=1, le=1024, description="LoRA rank")
    lora_alpha: float = Field(default=32.0, gt=0, description="LoRA scaling (alpha / r)")
    lora_dropout: float = Field(default=0.0, ge=0, lt=1, description="LoRA dropout")
    lora_target_modules: list[str] | None = Field(
        default=None, description="default: the attention and MLP projections of the architecture"
    )
    # losses and importance correction
    clip_low: float = Field(default=0.2, gt=0, lt=1, description="PPO clip below 1 (grpo, dr_grpo, dapo)")
    clip_high: float = Field(default=0.28, gt=0, description="PPO clip above 1 (grpo, dr_grpo, dapo)")
    cispo_weight_cap: float = Field(default=5.0, gt=1, description="CISPO's upper bound on the IS weight")
    token_truncate: float | None = Field(
        default=2.0,
        gt=1,
        description="truncated importance weight cap (grpo, dr_grpo, dapo; CISPO's cap is cispo_weight_cap)",
    )
    sequence_mask: tuple[float, float] | None = Field(
        default=(0.1, 10.0), description="sequences whose geometric-mean ratio falls outside carry no loss"
    )
    kl_coef: float = Field(default=0.0, ge=0, description="KL penalty to the base model (adapter off)")
    kto_beta: float = Field(
        default=0.1,
        gt=0,
        description="KTO's beta; episodes are desirable when their "
        "reward is above 0, undesirable below, and a reward of 0 (a tie) carries no loss",
    )
    checkpoint_every: int = Field(default=0, ge=0, description="optimizer steps between checkpoints (0: end only)")

    @model_validator(mode="after")
    def _coherent(self) -> TrainConfig:
        if self.sequence_mask is not None and not self.sequence_mask[0] < 1 < self.sequence_mask[1]:
            raise ValueError(f"train.sequence_mask must bracket 1 (lo < 1 < hi), got {self.sequence_mask}")
        if self.max_seq_len > self.batch_tokens:
            raise ValueError(
                f"train.batch_tokens ({self.batch_tokens}) must hold at least one episode of "
                f"train.max_seq_len ({self.max_seq_len}) tokens: raise batch_tokens or lower max_seq_len"
            )
        return self
