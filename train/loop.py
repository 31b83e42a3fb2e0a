"""The training loop: tokenized, rewarded episodes -> an updated LoRA adapter.

    advantages  group-relative where a prompt was sampled several times, batch-relative otherwise
    per optimizer step (`grad_accum` micro-batches):
        denominator = the loss's count (tokens, sequences, ...) over all the step's micro-batches
        for each micro-batch:
            logp     = log pi_theta(target token)                             [B, T]
            behavior = serving-time log mu(token)                             [B, T]
            weight, mask = importance correction the loss takes (losses.LOSSES) [B, T]
            loss     = aggregate(per_token(logp, behavior, adv) * weight + kl_coef * KL_k3, mask)
            (loss / denominator).backward()
    clip the gradient norm, AdamW step, log the step's metrics, checkpoint when due

The denominator is the step's, not each micro-batch's: a token mean is over every token of the
step and Dr. GRPO's constant counts every sequence of the step, so the gradient does not depend
on how the episodes were packed into micro-batches.

Episodes logged without behaviour log-probs (or with ones that could not be aligned) get them
recomputed once, before the first step, from the policy the run starts from (the champion):
exact when that policy served them, an approximation otherwise -- the caller counts which. This
keeps the importance ratio anchored to a fixed policy; a ratio pinned to 1 (logp.detach() at
every step) would let many epochs push those episodes without bound.

KL to the base model uses the adapter switched off as the reference (no second model in
memory) and Schulman's k3 estimator, exp(ref - logp) - (ref - logp) - 1, as TRL's GRPO does.
The learning rate is constant: runs are short continuations of the champion, not schedules
from scratch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.core.config import TrainConfig
from pipeline.core.faults import pause_point
from train.batches import MicroBatch, collate, mismatched_pairs, pack
from train.checkpoint import load_checkpoint, save_checkpoint
from train.data import TokenizedEpisode
from train.importance import CorrectionConfig, advantages, correct
from train.logprobs import recompute_behavior, reference_logprobs, set_behavior, token_logprobs
from train.losses import Loss, LossConfig, get_loss
from train.replicas import Replicas
from train.sampling import SamplingRows
from train.tracking import Tracker


@dataclass
class LoopResult:
    steps: int
    tokens: int
    seconds: float
    advantages: list[float]
    history: list[dict[str, float]] = field(default_factory=list)  # one dict of metrics per step


def correction_config(loss: Loss, cfg: TrainConfig) -> CorrectionConfig:
    """The importance corrections `loss` takes (losses.LOSSES says which): one per loss, as its
    paper defines it -- CISPO's weight cap is its own truncation, KTO takes none."""
    return CorrectionConfig(
        token_truncate=cfg.token_truncate if loss.token_truncation else None,
        token_mask=None,
        sequence_truncate=None,
        sequence_mask=cfg.sequence_mask if loss.sequence_mask else None,
    )


def loss_config(cfg: TrainConfig, max_completion_tokens: int, loss: Loss) -> LossConfig:
    return LossConfig(
        epsilon_low=cfg.clip_low,
        epsilon_high=getattr(cfg, loss.upper_bound) if loss.upper_bound else cfg.clip_high,
        max_completion_length=max_completion_tokens,
        kto_beta=cfg.kto_beta,
    )


def plan_microbatches(lengths: list[int], cfg: TrainConfig, world: int = 1) -> list[list[int]]:
    """Episode indices of every micro-batch of the run, in order: epochs until max_steps is
    covered (a step is grad_accum micro-batches on each of `world` replicas)."""
    plan: list[list[int]] = []
    epoch = 0
    needed = cfg.max_steps * cfg.grad_accum * world if cfg.max_steps else None
    while epoch < cfg.epochs or (needed and len(plan) < needed):
        plan += pack(lengths, cfg.batch_tokens, cfg.seed, epoch, grouped=cfg.group_by_length)
        epoch += 1
    return plan[:needed] if needed else plan


def kto_labels(rewards: torch.Tensor) -> torch.Tensor:
    """KTO's binary feedback from the rewards' sign: +1 desirable (reward > 0), -1 undesirable
    (< 0), 0 for a reward of exactly 0 -- no signal either way: no loss, counted as a tie."""
    return torch.sign(rewards)


def kl_reference_point(
    model: Any, episodes: list[TokenizedEpisode], micro: list[list[int]], sampling: SamplingRows, pad_id: int
) -> torch.Tensor:
    """KTO's reference point z, estimated once per optimizer step on mismatched pairs of the
    step's episodes (in id order, so it does not depend on how they were packed), in chunks of
    the largest micro-batch. []"""
    device = next(model.parameters()).device.type
    order = sorted(i for index in micro for i in index)
    pairs = mismatched_pairs(episodes, order)
    chunk, total = max(len(index) for index in micro), torch.zeros((), device=device)
    with torch.no_grad():
        for start in range(0, len(pairs), chunk):
            rows = list(range(start, min(start + chunk, len(pairs))))
            batch = collate(pairs, rows, pad_id, device)
            rows_sampling = sampling[torch.tensor(order[start : start + len(rows)], device=device)]
            policy = (token_logprobs(model, batch, rows_sampling)[0] * batch.mask).sum(-1)
            reference = (reference_logprobs(model, batch, rows_sampling) * batch.mask).sum(-1)
            total = total + (policy - reference).sum()
    return total / len(pairs)


@dataclass
class StepInputs:
    """What every micro-batch of a run needs besides its episodes (all [N], on the device)."""

    adv: torch.Tensor
    rewards: torch.Tensor
    sampling: SamplingRows
    recomputed: torch.Tensor  # bool: behaviour log-probs recomputed for this episode


def accumulate_step(
    model: Any,
    episodes: list[TokenizedEpisode],
    micro: list[list[int]],
    inputs: StepInputs,
    loss: Loss,
    loss_cfg: LossConfig,
    correction: CorrectionConfig,
    cfg: TrainConfig,
    pad_id: int,
    step_micro: list[list[int]] | None = None,
    world: int = 1,
    stand_ins: int = 0,
) -> tuple[dict[str, float], int]:
    """Forward and backward `micro`, this process's micro-batches of one optimizer step
    (gradients accumulate in the model); returns their summed metrics and token count.
    `step_micro`: every replica's micro-batches of the step (the denominator and KTO's reference
    point are the step's); `world` replicas average their gradients (DistributedDataParallel, or
    Replicas.average_gradients when sharded), so each scales its share by `world` to sum them;
    the last `stand_ins` micro-batches only join the collectives (zero weight)."""
    device = next(model.parameters()).device.type
    sums: dict[str, float] = {}
    step_micro = step_micro or micro

    def add(name: str, value: float) -> None:
        sums[name] = sums.get(name, 0.0) + value

    def labels_of(index: list[int]) -> torch.Tensor:
        return kto_labels(inputs.rewards[torch.tensor(index, device=device)])

    # the step's denominator before any backward pass: see the module docstring
    step_batches = [collate(episodes, index, pad_id, device) for index in step_micro]
    denominator = sum(
        float(loss.count(b.mask, loss_cfg, label=labels_of(index))) for b, index in zip(step_batches, step_micro)
    )
    denominator = max(denominator, 1.0)
    step_tokens = max(sum(float(b.mask.sum()) for b in step_batches), 1.0)
    z = kl_reference_point(model, episodes, step_micro, inputs.sampling, pad_id) if loss.reference else None
    collated = {id(index): b for index, b in zip(step_micro, step_batches)}  # this rank's are among the step's
    batches = [collated[id(index)] for index in micro]
    tokens = 0
    for k, (batch, index) in enumerate(zip(batches, micro)):
        label = labels_of(index)
        stand_in = k >= len(micro) - stand_ins
        # replicas exchange gradients once, after their last micro-batch of the step
        last = world == 1 or k == len(micro) - 1 or not hasattr(model, "no_sync")  # (sharded: see Replicas)
        with nullcontext() if last else model.no_sync():
            part = _micro_step(
                model,
                batch,
                index,
                label,
                inputs,
                loss,
                loss_cfg,
                correction,
                cfg,
                z,
                denominator,
                step_tokens,
                scale=0.0 if stand_in else float(world),
            )
        if stand_in:
            continue
        tokens += batch.tokens
        for name, value in part.items():
            if name == "log_ratio_min":
                sums[name] = min(sums.get(name, 0.0), value)
            elif name == "log_ratio_max":
                sums[name] = max(sums.get(name, 0.0), value)
            else:
                add(name, value)
    return sums, tokens


def _micro_step(
    model: Any,
    batch: MicroBatch,
    index: list[int],
    label: torch.Tensor,
    inputs: StepInputs,
    loss: Loss,
    loss_cfg: LossConfig,
    correction: CorrectionConfig,
    cfg: TrainConfig,
    z: torch.Tensor | None,
    denominator: float,
    step_tokens: float,
    scale: float,
) -> dict[str, float]:
    """One micro-batch's forward and backward (its loss times `scale`); returns its metric sums."""
    device = next(model.parameters()).device.type
    sums: dict[str, float] = {}

    def add(name: str, value: float) -> None:
        sums[name] = sums.get(name, 0.0) + value

    idx = torch.tensor(index, device=device)
    rows_sampling, a = inputs.sampling[idx], inputs.adv[idx]  # [B] each
    logp, entropy = token_logprobs(model, batch, rows_sampling)  # [B, T]
    behavior = batch.behavior  # [B, T]
    extra: dict[str, torch.Tensor] = {}
    if loss.reference:
        weight, mask, stats = torch.ones_like(logp), batch.mask, None  # KTO compares with the base, not mu
        ref = reference_logprobs(model, batch, rows_sampling)
        extra["ref_logp"] = (ref * mask).sum(-1)  # [B]
        extra["kl_ref"] = z
    else:
        weight, mask, stats = correct(logp, behavior, batch.mask, correction)
    if loss.labels:
        extra["label"] = label
        add("tie_sequences", float((label == 0).sum()))
    per_token = loss.per_token(logp, behavior, a, mask, loss_cfg) * weight  # [B, T]
    kl_term = None
    if cfg.kl_coef > 0:
        ref = reference_logprobs(model, batch, rows_sampling)
        kl_tok = torch.exp(ref - logp) - (ref - logp) - 1  # [B, T], k3 >= 0
        if loss.kl == "per_token":
            per_token = per_token + cfg.kl_coef * kl_tok
        else:  # not inside KTO's log-ratio sum: its own token mean over the step
            kl_term = cfg.kl_coef * (kl_tok * mask).sum() / step_tokens
        add("kl", float((kl_tok.detach() * mask).sum()))
    value = loss.aggregate(per_token, mask, loss_cfg, adv=a, **extra) / denominator
    if kl_term is not None:
        value = value + kl_term
    (value * scale).backward()

    add("loss", float(value.detach()))
    add("mask_tokens", float(mask.sum()))
    add("entropy", float((entropy * mask).sum()))
    add("recomputed_behavior", float(inputs.recomputed[idx].sum()))
    add("sequences", len(index))
    with torch.no_grad():
        log_r = (logp - behavior) * mask
        add("kl_behavior", float(-log_r.sum()))  # k1 estimate of KL(mu || pi) per token
        r = torch.exp(log_r)
        if loss.clip == "weight_cap":
            clipped = (r > loss_cfg.epsilon_high) & (mask > 0)
        else:
            clipped = (((r < 1 - cfg.clip_low) & (a[:, None] < 0)) | ((r > 1 + cfg.clip_high) & (a[:, None] > 0))) & (
                mask > 0
            )
        add("clipped_tokens", float(clipped.sum()) if loss.clip is not None else 0.0)
    if stats is not None:
        add("truncated_tokens", stats.truncated_tokens)
        add("masked_sequences", stats.masked_sequences)
        sums["log_ratio_min"] = min(sums.get("log_ratio_min", 0.0), stats.log_ratio_min)
        sums["log_ratio_max"] = max(sums.get("log_ratio_max", 0.0), stats.log_ratio_max)
    return sums


def train_policy(
    model: Any,
    episodes: list[TokenizedEpisode],
    rewards: list[float],
    groups: list[str],
    cfg: TrainConfig,
    tracker: Tracker,
    pad_id: int,
    checkpoint_dir: Path | None = None,
    resume_from: Path | None = None,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
    replicas: Replicas = Replicas(),
) -> LoopResult:
    """Train the (peft-wrapped) `model` in place. `resume_from` is a checkpoint directory whose
    adapter the caller has loaded into `model`; the optimizer, RNG and step come from it.
    Under torch.distributed (train/distributed.py) `model` is the DistributedDataParallel
    wrapper and `replicas` says which rank this is; only the main rank logs and checkpoints."""
    device = next(model.parameters()).device.type
    reward_t = torch.tensor(rewards, dtype=torch.float32, device=device)  # [N]
    sampling = SamplingRows.of(episodes, device)  # [N] each: what each episode was sampled with
    plan = plan_microbatches([len(e.input_ids) for e in episodes], cfg, replicas.world)
    per_step = cfg.grad_accum * replicas.world  # micro-batches of one optimizer step, over every replica
    total_steps = math.ceil(len(plan) / per_step)
    loss = get_loss(cfg.loss)
    adv = advantages(
        rewards, groups, mode=cfg.advantage, episodes=[e.episode for e in episodes], scale=loss.scale_advantages
    ).to(device)  # [N]
    loss_cfg = loss_config(cfg, max(sum(e.loss_mask) for e in episodes), loss)
    correction = correction_config(loss, cfg)

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate, weight_decay=cfg.weight_decay
    )
    missing = [i for i, e in enumerate(episodes) if e.behavior is None]
    if resume_from:
        start, extra = load_checkpoint(resume_from, optimizer)
        recomputed = extra.get("recomputed_behavior", torch.zeros(0, 1))
        set_behavior(episodes, missing, recomputed)
    else:
        start, recomputed = 0, recompute_behavior(model, episodes, pad_id, cfg.batch_tokens, sampling)
    recomputed_flag = torch.zeros(len(episodes), dtype=torch.bool, device=device)
    recomputed_flag[missing] = True
    inputs = StepInputs(adv, reward_t, sampling, recomputed_flag)
    model.train()
    result = LoopResult(steps=start, tokens=0, seconds=0.0, advantages=adv.tolist())
    for step in range(start, total_steps):
        t0 = time.perf_counter()
        micro = plan[step * per_step : (step + 1) * per_step]
        mine, stand_ins = replicas.mine(micro)
        sums, tokens = accumulate_step(
            model,
            episodes,
            mine,
            inputs,
            loss,
            loss_cfg,
            correction,
            cfg,
            pad_id,
            step_micro=micro,
            world=replicas.world,
            stand_ins=stand_ins,
        )
        sums, tokens = replicas.merge(sums, tokens)
        replicas.average_gradients([p for p in model.parameters() if p.requires_grad])

        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm or float("inf")
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - t0

        step_idx = torch.tensor([i for m in micro for i in m], device=device)
        n_tok = max(sums["mask_tokens"], 1.0)
        metrics = {
            "loss": sums["loss"],
            "reward_mean": float(reward_t[step_idx].mean()),
            "reward_std": float(reward_t[step_idx].std(unbiased=False)),
            "advantage_mean": float(adv[step_idx].mean()),
            "advantage_std": float(adv[step_idx].std(unbiased=False)),
            "entropy": sums["entropy"] / n_tok,
            "kl_behavior": sums["kl_behavior"] / n_tok,
            "clip_frac": sums["clipped_tokens"] / n_tok,
            "truncated_token_frac": sums.get("truncated_tokens", 0.0) / n_tok,
            "masked_sequence_frac": sums.get("masked_sequences", 0.0) / sums["sequences"],
            "log_ratio_min": sums.get("log_ratio_min", 0.0),
            "log_ratio_max": sums.get("log_ratio_max", 0.0),
            "recomputed_behavior_frac": sums["recomputed_behavior"] / sums["sequences"],
            "grad_norm": float(grad_norm),
            "tokens_per_s": tokens / seconds,
            "learning_rate": cfg.learning_rate,
        }
        if "kl" in sums:
            metrics["kl"] = sums["kl"] / n_tok
        if "tie_sequences" in sums:
            metrics["tie_sequences"] = sums["tie_sequences"]
        if replicas.main:
            tracker.log_metrics(metrics, step=step + 1)
        result.history.append(metrics)
        result.steps, result.tokens, result.seconds = step + 1, result.tokens + tokens, result.seconds + seconds
        if checkpoint_dir is not None and cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            if replicas.main:  # every replica holds the same weights and optimizer state
                save_checkpoint(
                    checkpoint_dir / f"step-{step + 1}",
                    getattr(model, "module", model),
                    optimizer,
                    step + 1,
                    extra={"recomputed_behavior": recomputed},
                )
            replicas.barrier()
        pause_point("train.step")  # crash tests kill the process here
        if on_step:
            on_step(step + 1, total_steps, metrics)
    return result
