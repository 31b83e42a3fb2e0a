"""The sections that decide what ships: `[gate]` (when a candidate may replace the champion,
deploy/gate.py), `[outcome]` (the outcome model that scores the gate's fresh answers,
train/outcome.py) and `[rollout]` (the canary's sequential test, deploy/rollout.py), with the
durations they and `[cycle]` are written in. Split from pipeline/core/config.py, which
assembles every section."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pipeline.core.config_section import Section as _Section


class Bound(_Section):
    """Limits on one evaluation metric: absolute, and as a change from the champion (the
    direction is in the name: an increase or a decrease beyond the limit fails)."""

    min: float | None = None
    max: float | None = None
    max_increase: float | None = Field(default=None, ge=0)
    max_decrease: float | None = Field(default=None, ge=0)
    max_rel_increase: float | None = Field(default=None, ge=0, description="fraction of the champion's value")
    max_rel_decrease: float | None = Field(default=None, ge=0, description="fraction of the champion's value")

    @model_validator(mode="after")
    def _ordered(self) -> Bound:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


def _default_bounds() -> dict[str, Bound]:
    return {
        "abstention_rate": Bound(max=0.3, max_increase=0.05),
        "repetition_rate": Bound(max=0.3, max_increase=0.05),
        "tool_format_error_rate": Bound(max=0.1, max_increase=0.02),
        "tool_format_error_rate_after_result": Bound(max=0.1, max_increase=0.02),
        "mean_length": Bound(max_rel_increase=0.5, max_rel_decrease=0.5),
        "smoke_latency_ms": Bound(max_rel_increase=1.0),
    }


class GateConfig(_Section):
    """When a candidate may replace the champion. Every criterion must hold."""

    min_improvement: float = Field(
        default=0.0, description="the lower confidence bound of (candidate - champion) reward must exceed this"
    )
    confidence: float = Field(
        default=0.95, gt=0.5, lt=1, description="two-sided confidence of the improvement's interval"
    )
    bootstrap: int = Field(default=1000, ge=100, le=100_000, description="paired bootstrap resamples of that interval")
    min_ess: float = Field(default=20.0, ge=1, description="effective sample size below which the estimate is refused")
    max_kl: float = Field(default=0.5, gt=0, description="KL(champion || candidate) per token")
    sequence_ratio_cap: float = Field(default=20.0, gt=1, description="clip of the sequence IS ratio")
    bounds: dict[str, Bound] = Field(
        default_factory=_default_bounds,
        description=(
            "canary metrics' limits ([gate.bounds.<metric>]: min, max, max_increase, max_rel_increase, "
            "max_rel_decrease); the ones set replace the default of that metric"
        ),
    )
    suite: Path | None = Field(default=None, description="regression suite TOML (deploy/suite.py)")
    eval_episodes: int = Field(default=500, ge=1, description="most recent held-out episodes to evaluate on")
    generate_prompts: int = Field(default=32, ge=1, description="held-out prompts each policy answers (canaries)")
    max_new_tokens: int = Field(default=64, ge=1, description="tokens each policy writes per canary prompt")
    tool_prompts: int = Field(
        default=64,
        ge=0,
        description="held-out prompts that offered tools, of each kind (a "
        "task's first call; a call after a tool's result), the tool-format canary samples",
    )
    tool_samples: int = Field(
        default=4,
        ge=0,
        description="answers each policy samples at the serving temperature "
        "per such prompt: the tool-format canary (tool_format_error_rate, "
        "tool_format_error_rate_after_result)",
    )
    estimator: Literal["direct", "doubly_robust", "importance"] = Field(
        default="direct",
        description="what the improvement check reads (deploy/estimators.py): fresh answers "
        "scored by the outcome model; that plus the importance-weighted residuals of the logged episodes; or "
        "the logged episodes importance-weighted (the lower bound of SNIS and plain IS). Every decision records "
        "all three. direct measured with the smallest bias, toward refusing, against the truth (docs/benchmarks.md, "
        '"The gate\'s estimators")',
    )
    fallback: Literal["importance", "refuse"] = Field(
        default="importance",
        description="when the estimator needs the outcome model and it is missing or "
        "unusable: decide by importance sampling (the decision says so), or refuse the candidate",
    )
    fresh_prompts: int = Field(
        default=256,
        ge=0,
        description="held-out requests whose prompts each policy "
        "answers afresh at serving's sampling settings, for the outcome model to score (0: none)",
    )
    fresh_samples: int = Field(
        default=8,
        ge=1,
        description="answers per such prompt and policy: the improvement's "
        "noise is mostly which answers were drawn, and 8 a prompt let a candidate 5 pp better "
        "pass ~95 % of the time against 2's ~45 % (docs/benchmarks.md, \"The canary's "
        'sequential test"); each answer costs a generation',
    )
    first_deployment: Literal["base", "absolute", "refuse"] = Field(
        default="base",
        description="with no champion: the base model (what serves until the first promotion) "
        "stands in for the champion in every check; or absolute bounds only; or refuse "
        "(promote by hand)",
    )

    @model_validator(mode="before")
    @classmethod
    def _bounds_extend_the_defaults(cls, data: Any) -> Any:
        # [gate.bounds.mean_length] in a file changes that metric's bounds, not the whole table
        if isinstance(data, dict) and isinstance(data.get("bounds"), dict):
            defaults = {k: v.model_dump(exclude_none=True) for k, v in _default_bounds().items()}
            data = {**data, "bounds": {**defaults, **data["bounds"]}}
        return data


class OutcomeConfig(_Section):
    """The outcome model (train/outcome.py): predicts an answer's reward from its prompt and
    text, for the gate's fresh answers. Learned from the training slice's rewarded episodes;
    never a training reward."""

    enabled: bool = Field(
        default=True,
        description="fit one (refreshed as rewards arrive); off: the gate decides by importance sampling only",
    )
    max_episodes: int = Field(
        default=4000, ge=50, description="most recent rewarded episodes of the training slice it learns from"
    )
    refresh_episodes: int = Field(
        default=500,
        ge=1,
        description="new rewarded episodes since the last fit after which the next cycle fits it again",
    )
    min_episodes: int = Field(
        default=200, ge=8, description="episodes needed to fit (and a quarter of it each to calibrate and to check)"
    )
    check_percent: float = Field(
        default=30.0,
        gt=0,
        lt=100,
        description="share of tasks (by hash) kept out of the fit: half calibrates, half measures the figures below",
    )
    min_auroc: float = Field(
        default=0.6,
        ge=0.5,
        le=1.0,
        description="a model that ranks the checked episodes' "
        "rewards worse than this is reported and not used (for a graded reward even the exact "
        "expected reward ranks far below 1: 0.72 on the demo's)",
    )
    min_r2: float = Field(
        default=0.2,
        ge=0.0,
        le=1.0,
        description="the same for the share of the checked rewards' "
        "variance it explains (1 - Brier / the Brier of predicting the mean)",
    )
    max_calibration_error: float = Field(
        default=0.05,
        gt=0,
        le=1.0,
        description="the same for its "
        "calibration error (debiased: a bin's sampling noise is not counted; "
        "rewards scaled to [0, 1]; train/calibration.py)",
    )
    epochs: int = Field(default=8, ge=1, le=50, description="passes over the fit slice")
    learning_rate: float = Field(default=3e-3, gt=0, description="AdamW, cosine to 0")
    batch_size: int = Field(default=32, ge=1, description="episodes per step")
    lora_r: int = Field(default=8, ge=1, description="rank of its LoRA adapter on the base model")
    pooling: Literal["last", "mean"] = Field(
        default="mean",
        description="what its value head reads: the last token's hidden state, or that and the mean "
        "over the completion's tokens (train/outcome.py; on a demo's store the mean ranks and "
        "separates versions better: docs/benchmarks.md)",
    )


DURATION = re.compile(r"\d+(\.\d+)?[smhd]")  # '30s', '15m', '4h', '1d' (cycle.every, rollout.*)
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(value: str) -> float:
    """'30s' / '15m' / '4h' / '1d' -> seconds."""
    return float(value[:-1]) * _UNIT_S[value[-1]]


class RolloutConfig(_Section):
    """Staged rollout: a candidate that passed the gate first serves a share of live requests
    as the `canary`, and is promoted only if a sequential test on its online mean reward shows
    it is not worse than the champion's by more than `margin`, over the same period
    (deploy/sequential.py: valid however often it is looked at)."""

    share: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="share of requests the canary serves; "
        "0: no staged rollout, a candidate that passes the gate is promoted at once",
    )
    min_requests: int = Field(
        default=50,
        ge=10,
        description="rewarded episodes each side needs before the "
        "sequential test's first look (its normal approximation); an agent's episode "
        "counts once",
    )
    max_requests: int = Field(
        default=2000,
        ge=10,
        description="episodes a side at which a test that met neither "
        "boundary stops: the canary is withdrawn, not shown to be within the margin",
    )
    margin: float = Field(
        default=0.05,
        ge=0.0,
        description="how much lower (in reward) the canary's mean may "
        "be than the champion's and still pass: a canary worse by more is promoted with "
        "probability <= 1 - confidence",
    )
    effect: float = Field(
        default=0.05,
        description="the improvement (in reward) the test is sized for: a canary "
        "this much better is withdrawn with probability <= 1 - power; must exceed -margin",
    )
    confidence: float = Field(
        default=0.95,
        gt=0.5,
        lt=1.0,
        description="1 - the probability of promoting a "
        "canary worse than the margin, however often the test is looked at",
    )
    power: float = Field(
        default=0.8,
        gt=0.0,
        lt=1.0,
        description="1 - the probability that the futility boundary withdraws a canary `effect` better",
    )
    covariate: Literal["prompt", "user", "none"] = Field(
        default="prompt",
        description="the variance-reducing covariate of an episode (CUPED), fixed before it was "
        "assigned: the mean reward, before the canary went live, of its first call's prompt, or of its user",
    )
    covariate_history: int = Field(
        default=5000,
        ge=0,
        description="most recent rewarded calls before the canary went live that the covariate is computed from",
    )
    max_tool_error_increase: float | None = Field(
        default=0.02,
        ge=0.0,
        description="how much higher the canary's share of served calls with a malformed tool "
        "call may be than the champion's (the same one-sided confidence), checked when the reward test decides "
        "-- the online tool-format canary; unset: not checked",
    )
    max_wait: str = Field(
        default="24h",
        description="a canary without a decision after this long is withdrawn (never promoted unmeasured): <n>s|m|h|d",
    )
    check_every: str = Field(default="5m", description="how often the daemon checks a canary between cycles")

    @model_validator(mode="after")
    def _effect_above_the_margin(self) -> RolloutConfig:
        if not self.effect > -self.margin:
            raise ValueError(f"rollout.effect ({self.effect:g}) must exceed -rollout.margin ({-self.margin:g})")
        if self.max_requests < self.min_requests:
            raise ValueError(
                f"rollout.max_requests ({self.max_requests}) is below rollout.min_requests ({self.min_requests})"
            )
        return self

    @field_validator("max_wait", "check_every")
    @classmethod
    def _duration(cls, value: str) -> str:
        if DURATION.fullmatch(value.strip()):
            return value.strip()
        raise ValueError(f"must be a duration such as '90s', '15m', '4h', '1d' (got {value!r})")
