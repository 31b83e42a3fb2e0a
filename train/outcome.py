"""The outcome model: an answer's expected reward, from what was asked and what was answered.

    model      the policy's own base model (the same tokenizer and chat template) with a LoRA
               adapter, and a linear value head on the last hidden state of prompt + completion
               -- the tokens training sees (train/data.py) -- pooled by `outcome.pooling`:
                 last   the last token's [H]
                 mean   the last token's and the mean over the completion's tokens, [2H]: a
                        judgement made token by token (is this token right, here?) needs no
                        layer to carry it to the last position, which a small base cannot
    target     the reward scaled to [0, 1] by the fit slice's range; the loss is binary
               cross-entropy with the scaled reward as a soft label (fractional logit regression,
               Papke & Wooldridge 1996): minimised by E[r | prompt, answer], whatever the
               reward's distribution, so a graded reward needs nothing else
    data       rewarded episodes of the training slice (never the gate's held-out slice), split
               by task into fit / calibrate / check (`check_percent`, halves of it): a task falls
               on one side only, so the figures are for prompts the model never saw
    calibrate  isotonic regression of reward on score on the calibration slice
               (train/calibration.py); the check slice measures the calibrated predictions
    usable     the check's AUROC >= min_auroc, R2 >= min_r2 and calibration error <=
               max_calibration_error; otherwise it is kept and reported but the gate does not use it.
               Measured on a demo run's store (2,742 episodes, 8 epochs, 29 s on two cores): AUROC
               0.72, R2 0.49, calibration error 0.034 -- against 0.72 / 0.84 / 0.021 for the
               simulated users' exact expected reward (the ceiling: a graded reward's ties and
               noise bound the AUROC)

It predicts; it never rewards: training reads the spec's rewards, and this model is used only
where a policy's answers have no outcome yet (the gate's fresh answers, deploy/estimators.py).
"""

from __future__ import annotations

import json
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.config import OutcomeConfig, TrainConfig
from pipeline.core.types import LoggedEpisode
from train.calibration import Isotonic, Quality
from train.data import TokenizedEpisode, tokenize_episode
from train.lora import attach_adapter, load_adapter, save_adapter
from train.models import load_policy
from train.outcome_record import MANIFEST


def split_of(task: bytes, check_percent: float) -> str:
    """ "fit", "calibrate" or "check": by a hash of the task apart from the held-out slice's
    (pipeline/core/store/training.py), so that the two splits are independent."""
    slot = zlib.crc32(b"outcome-model:" + task) % 10_000
    if slot >= check_percent * 100:
        return "fit"
    return "calibrate" if slot < check_percent * 50 else "check"


@dataclass
class Fitted:
    """What a fit produced and what the gate reads: where it is, what data, how good."""

    path: Path
    base_model: str
    episodes: dict[str, int]  # fit, calibrate, check
    window: dict[str, Any]  # reward ids (and served times) of the episodes it learned from
    reward_range: tuple[float, float]
    quality: Quality  # on the check slice
    usable: bool
    why: str  # why it is (not) usable
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "path": str(self.path), "quality": self.quality.to_dict()}


class OutcomeModel:
    """The value model on top of a base; `score` gives calibrated predictions."""

    def __init__(
        self,
        policy: Any,
        head: torch.nn.Linear,
        calibration: Isotonic | None,
        reward_range: tuple[float, float],
        max_seq_len: int,
        pooling: str = "last",
    ) -> None:
        self.policy, self.head, self.calibration = policy, head, calibration
        self.reward_range, self.max_seq_len, self.pooling = reward_range, max_seq_len, pooling

    @classmethod
    def load(cls, path: str | Path, device: str | None = None) -> OutcomeModel:
        path = Path(path)
        manifest = json.loads((path / MANIFEST).read_text())
        policy = load_policy(manifest["base_model"], device=device)
        policy.model = load_adapter(policy.model, path / "adapter", trainable=False)
        pooling = manifest.get("pooling", "last")  # (a fit from before pooling was a setting)
        head = _head(policy.model, pooling)
        head.load_state_dict(torch.load(path / "head.pt", map_location=policy.device, weights_only=True))
        cal = manifest["calibration"]
        return cls(
            policy,
            head,
            Isotonic(tuple(cal["x"]), tuple(cal["y"])),
            tuple(manifest["reward_range"]),
            manifest["max_seq_len"],
            pooling,
        )

    def _tokenize(self, episodes: Sequence[LoggedEpisode]) -> list[TokenizedEpisode | None]:
        out = []
        for e in episodes:
            t = tokenize_episode(
                self.policy.tokenizer, e.request_id, e.prompt, e.completion, e.completion_token_ids, tools=e.tools
            )
            if isinstance(t, TokenizedEpisode):
                # the value head reads the end: a long prompt loses its start, not its answer
                t.input_ids, t.loss_mask = t.input_ids[-self.max_seq_len :], t.loss_mask[-self.max_seq_len :]
            out.append(t if isinstance(t, TokenizedEpisode) and t.input_ids else None)
        return out

    def _logits(self, rows: list[TokenizedEpisode]) -> torch.Tensor:
        """[B] the head's logit on each row's pooled hidden state (right-padded batch [B, T])."""
        pad = self.policy.tokenizer.pad_token_id or 0
        width = max(len(r.input_ids) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        answer = torch.zeros((len(rows), width))  # [B, T] 1 on the completion's tokens
        for b, r in enumerate(rows):
            ids[b, : len(r.input_ids)], attention[b, : len(r.input_ids)] = torch.tensor(r.input_ids), 1
            answer[b, : len(r.loss_mask)] = torch.tensor(r.loss_mask, dtype=torch.float)
        device = self.policy.device
        hidden = (
            self.policy.model(input_ids=ids.to(device), attention_mask=attention.to(device), output_hidden_states=True)
            .hidden_states[-1]
            .float()
        )  # [B, T, H]
        last = attention.sum(dim=1).to(device) - 1  # [B]
        features = hidden[torch.arange(len(rows), device=device), last]  # [B, H]
        if self.pooling == "mean":
            answer = answer.to(device).unsqueeze(-1)  # [B, T, 1]
            mean = (hidden * answer).sum(dim=1) / answer.sum(dim=1).clamp(min=1.0)  # [B, H]
            features = torch.cat([features, mean], dim=-1)  # [B, 2H]
        return self.head(features).squeeze(-1)

    @torch.no_grad()
    def raw(self, episodes: Sequence[LoggedEpisode], batch_size: int = 64) -> list[float | None]:
        """Uncalibrated predictions on the reward's scale (None: the episode does not tokenize)."""
        self.policy.model.eval()
        tokenized = self._tokenize(episodes)
        keep = [i for i, t in enumerate(tokenized) if t is not None]
        out: list[float | None] = [None] * len(episodes)
        low, high = self.reward_range
        for k in range(0, len(keep), batch_size):
            idx = keep[k : k + batch_size]
            p = torch.sigmoid(self._logits([tokenized[i] for i in idx])).cpu().numpy()
            for i, v in zip(idx, p):
                out[i] = float(low + (high - low) * v)
        return out

    def score(self, episodes: Sequence[LoggedEpisode]) -> list[float | None]:
        """Calibrated predictions of each episode's reward (None: it does not tokenize)."""
        raw = self.raw(episodes)
        have = [i for i, v in enumerate(raw) if v is not None]
        out: list[float | None] = [None] * len(raw)
        if have:
            cal = self.calibration(np.array([raw[i] for i in have])) if self.calibration else [raw[i] for i in have]
            for i, v in zip(have, cal):
                out[i] = float(v)
        return out


def _head(model: Any, pooling: str) -> torch.nn.Linear:
    hidden = model.config.hidden_size if hasattr(model.config, "hidden_size") else model.config.n_embd
    head = torch.nn.Linear(hidden * (2 if pooling == "mean" else 1), 1)
    torch.nn.init.zeros_(head.weight), torch.nn.init.zeros_(head.bias)  # starts at E[r] ~ the middle
    return head.to(next(model.parameters()).device)


def fit(
    base_model: str | Path,
    episodes: Sequence[LoggedEpisode],
    tasks: Sequence[bytes | None],
    out: Path,
    cfg: OutcomeConfig,
    train: TrainConfig,
    window: dict[str, Any] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Fitted:
    """Fit, calibrate and check an outcome model on `episodes` (each with its task, None: its
    request id stands for it), and save it under `out`. Raises ValueError when there are too few
    episodes to fit."""
    started = time.perf_counter()
    torch.manual_seed(train.seed)
    split: dict[str, list[LoggedEpisode]] = {"fit": [], "calibrate": [], "check": []}
    for e, task in zip(episodes, tasks):
        split[split_of(task if task is not None else e.request_id.encode(), cfg.check_percent)].append(e)
    counts = {k: len(v) for k, v in split.items()}
    if counts["fit"] < cfg.min_episodes or min(counts["calibrate"], counts["check"]) < cfg.min_episodes // 4:
        raise ValueError(
            f"too few rewarded episodes to fit an outcome model: {counts} (needs "
            f"{cfg.min_episodes} to fit and {cfg.min_episodes // 4} each to calibrate and check; "
            "outcome.min_episodes)"
        )
    rewards = np.array([e.reward for e in split["fit"]])
    low, high = float(rewards.min()), float(rewards.max())
    policy = load_policy(base_model, device=train.torch_device)
    lora = train.model_copy(update={"lora_r": cfg.lora_r, "lora_alpha": 2 * cfg.lora_r, "lora_dropout": 0.0})
    policy.model = attach_adapter(policy.model, lora)
    span = (low, high) if high > low else (low, low + 1.0)
    model = OutcomeModel(policy, _head(policy.model, cfg.pooling), None, span, train.max_seq_len, cfg.pooling)
    _train(model, split["fit"], cfg, train.seed, progress)
    calibrate = split["calibrate"]
    raw_cal = model.raw(calibrate)
    have = [i for i, v in enumerate(raw_cal) if v is not None]
    model.calibration = Isotonic.fit(
        np.array([raw_cal[i] for i in have]), np.array([calibrate[i].reward for i in have])
    )
    pred = model.score(split["check"])
    have = [i for i, v in enumerate(pred) if v is not None]
    quality = Quality.measure(
        np.array([pred[i] for i in have]), np.array([split["check"][i].reward for i in have]), *model.reward_range
    )
    usable, why = judge(quality, cfg)
    out.mkdir(parents=True, exist_ok=True)
    save_adapter(policy.model, out / "adapter")
    torch.save(model.head.state_dict(), out / "head.pt")
    fitted = Fitted(
        out,
        str(base_model),
        counts,
        window or {},
        model.reward_range,
        quality,
        usable,
        why,
        round(time.perf_counter() - started, 3),
    )
    (out / MANIFEST).write_text(
        json.dumps(
            {
                **fitted.to_dict(),
                "fitted_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "max_seq_len": train.max_seq_len,
                "pooling": cfg.pooling,
                "calibration": {"x": list(model.calibration.x), "y": list(model.calibration.y)},
            },
            indent=2,
        )
    )
    return fitted


def judge(quality: Quality, cfg: OutcomeConfig) -> tuple[bool, str]:
    """Whether the gate may use a model of this quality, and why (not)."""
    figures = (
        f"AUROC {quality.auroc:.3f} (min {cfg.min_auroc:g}), R2 {quality.r2:.3f} (min {cfg.min_r2:g}), "
        f"calibration error {quality.calibration_error:.3f} (max {cfg.max_calibration_error:g}), on "
        f"{quality.episodes} checked episodes"
    )
    # (nan: every checked reward the same -- nothing to rank or explain)
    if not (quality.auroc >= cfg.min_auroc and quality.r2 >= cfg.min_r2):
        return False, f"too weak: {figures}"
    if not quality.calibration_error <= cfg.max_calibration_error:
        return False, f"too poorly calibrated: {figures}"
    return True, figures


def _train(
    model: OutcomeModel,
    episodes: list[LoggedEpisode],
    cfg: OutcomeConfig,
    seed: int,
    progress: Callable[[int, int], None] | None,
) -> None:
    tokenized = [(t, e.reward) for t, e in zip(model._tokenize(episodes), episodes) if t is not None]
    low, high = model.reward_range
    params = [p for p in model.policy.model.parameters() if p.requires_grad] + list(model.head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=0.0)
    steps = cfg.epochs * math.ceil(len(tokenized) / cfg.batch_size)
    rng = random.Random(seed)
    model.policy.model.train()
    step = 0
    for _ in range(cfg.epochs):
        rng.shuffle(tokenized)
        for k in range(0, len(tokenized), cfg.batch_size):
            batch = tokenized[k : k + cfg.batch_size]
            target = torch.tensor([(r - low) / (high - low) for _, r in batch], device=model.policy.device)
            lr = cfg.learning_rate * 0.5 * (1 + math.cos(math.pi * step / max(steps, 1)))  # cosine to 0
            for g in opt.param_groups:
                g["lr"] = lr
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                model._logits([t for t, _ in batch]), target.clamp(0, 1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if progress is not None:
                progress(step, steps)
    model.policy.model.eval()
