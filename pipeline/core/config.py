"""One validated config object: embedded defaults < TOML file < RTRL_* environment variables.

    [store]  url = "sqlite:///<state>/rtrl.db"
    [kafka]  bootstrap = "127.0.0.1:19092"   ([kafka.security]: TLS and SASL, pipeline/core/kafka_config.py)
    [ingest] group_id = "rtrl-ingest", batch_max_records = 2000, ...
    [train]  base_model = "/models/base", loss = "cispo", learning_rate = 1e-4, ...
    [mlflow] tracking_uri = "http://mlflow:5000" (default: a SQLite store in the state folder)
    [rollout] share = 0.1 (a passing candidate serves 10 % of requests before promotion)

Environment overrides use the section and key joined by a double underscore, e.g.
`RTRL_INGEST__GROUP_ID=workers`, plus the short forms `RTRL_STATE_DIR`, `RTRL_DB_URL`,
`RTRL_KAFKA_BOOTSTRAP` and `RTRL_KAFKA_PASSWORD` that operators actually type. A bad value is
refused at load time with the field and what is allowed; a secret written in the file is refused.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.core.kafka_config import SECRET_FIELDS, KafkaAccess, KafkaConfig
from pipeline.core.train_config import LossName, TrainConfig  # noqa: F401 - re-exported

DEFAULT_STATE_DIR = Path.home() / ".rtrl"


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StoreConfig(_Section):
    url: str | None = Field(default=None, description="SQLAlchemy URL; default: a SQLite file in the state folder")


class IngestConfig(_Section):
    group_id: str = Field(default="rtrl-ingest", min_length=1, description="the Kafka consumer group of ingest")
    topics: list[str] | None = Field(default=None, description="default: the interactions and feedback topics")
    batch_max_records: int = Field(
        default=2000, ge=1, le=100_000, description="records stored in one transaction (with their offsets)"
    )
    poll_timeout_ms: int = Field(default=500, ge=10, le=60_000, description="how long one poll waits for records")
    session_timeout_ms: int = Field(
        default=10_000,
        ge=6_000,
        le=300_000,
        description="a worker that dies is replaced after this long (broker allows 6s..300s)",
    )
    lanes: int = Field(
        default=1,
        ge=0,
        le=16,
        description="worker processes that decode and store, partition-affine (0 = in the consumer's process)",
    )
    max_in_flight: int = Field(default=2, ge=1, le=16, description="batches queued per lane")
    max_event_bytes: int = Field(default=1_048_576, ge=256, description="larger records become dead letters")
    start: Literal["earliest", "latest"] = Field(
        default="earliest",
        description="where a partition the store has no offset for starts: the beginning "
        "of retention, or only what arrives from now (Kafka's committed offsets are never used: a new store "
        "would silently skip what an older one consumed)",
    )


class RewardConfig(_Section):
    spec: Path | None = Field(default=None, description="reward spec TOML; default: the one shipped with rtrl")


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


class CycleConfig(_Section):
    """The loop's schedule and when a cycle is worth running."""

    every: str = Field(default="4h", description="interval between cycles: <n>s|m|h|d, or a 5-field cron expression")
    min_new_episodes: int = Field(default=50, ge=1, description="fewer new rewarded episodes: the cycle is skipped")
    sla_s: float = Field(default=3600.0, gt=0, description="a cycle longer than this is logged and counted")

    @field_validator("every")
    @classmethod
    def _schedule(cls, value: str) -> str:
        if DURATION.fullmatch(value.strip()) or len(value.split()) == 5:
            return value.strip()
        raise ValueError(
            f"cycle.every must be an interval such as '30s', '15m', '4h', '1d' or a 5-field cron "
            f"expression such as '0 */4 * * *' (got {value!r})"
        )


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


class MlflowConfig(_Section):
    tracking_uri: str | None = Field(
        default=None, description="MLflow tracking server URL; default: a SQLite store in the state folder"
    )
    experiment: str = Field(default="rtrl", description="MLflow experiment of the training runs")
    registered_model: str = Field(default="rtrl-policy", description="registry name of the served adapter")


class SpoolConfig(_Section):
    """Where events wait while the broker is away (pipeline/core/spool.py): rtrl serve's
    interaction events, under <state>/spool/."""

    max_bytes: int = Field(default=1 << 30, ge=1 << 16, description="the spool's bound on disk")
    when_full: Literal["refuse", "block"] = Field(
        default="refuse",
        description=(
            "a full spool refuses new events (counted in rtrl_serve_events_undelivered, logged) or blocks "
            "the producer until the broker is back"
        ),
    )


class Config(_Section):
    state_dir: Path = Field(
        default=DEFAULT_STATE_DIR,
        description=("where rtrl keeps its files: the SQLite store, the local broker, training runs, caches"),
    )
    store: StoreConfig = StoreConfig()
    kafka: KafkaConfig = KafkaConfig()
    ingest: IngestConfig = IngestConfig()
    reward: RewardConfig = RewardConfig()
    train: TrainConfig = TrainConfig()
    mlflow: MlflowConfig = MlflowConfig()
    gate: GateConfig = GateConfig()
    outcome: OutcomeConfig = OutcomeConfig()
    cycle: CycleConfig = CycleConfig()
    rollout: RolloutConfig = RolloutConfig()
    spool: SpoolConfig = SpoolConfig()

    # --- derived values: computed, never stored twice -------------------------------------
    @property
    def db_url(self) -> str:
        return self.store.url or f"sqlite:///{self.state_dir / 'rtrl.db'}"

    @property
    def tracking_uri(self) -> str:
        return self.mlflow.tracking_uri or f"sqlite:///{self.state_dir / 'mlflow.db'}"

    @property
    def artifact_root(self) -> Path:
        """Where the embedded tracking store keeps run artifacts (a server keeps its own)."""
        return self.state_dir / "mlartifacts"

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap or f"127.0.0.1:{self.kafka.port}"

    @property
    def kafka_access(self) -> KafkaAccess:
        """What every Kafka client is built from (pipeline/core/kafka_client.py)."""
        return KafkaAccess(
            self.bootstrap, self.kafka.security, self.kafka.connect_timeout_s, self.kafka.max_message_bytes
        )

    @property
    def ingest_topics(self) -> list[str]:
        return self.ingest.topics or [self.kafka.interactions_topic, self.kafka.feedback_topic]


_SHORT_ENV = {
    "RTRL_STATE_DIR": ("state_dir",),
    "RTRL_DB_URL": ("store", "url"),
    "RTRL_KAFKA_BOOTSTRAP": ("kafka", "bootstrap"),
    "RTRL_KAFKA_PASSWORD": ("kafka", "security", "password"),
}


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name, value in environ.items():
        if name in _SHORT_ENV:
            path = _SHORT_ENV[name]
        elif name.startswith("RTRL_") and "__" in name:
            path = tuple(part.lower() for part in name[len("RTRL_") :].split("__"))
        else:
            continue
        node = overrides
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value.split(",") if path[-1] == "topics" else value
    return overrides


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None, environ: dict[str, str] | None = None, under: dict[str, Any] | None = None
) -> Config:
    """Load the config: defaults, then `under` (a command's own settings, e.g. the demo's), then
    the TOML file (if any), then RTRL_* variables: the user's file and environment always win."""
    environ = dict(os.environ if environ is None else environ)
    path = path or environ.get("RTRL_CONFIG")
    data: dict[str, Any] = {}
    if path:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    written = [k for k in SECRET_FIELDS if k in data.get("kafka", {}).get("security", {})]
    if written:
        raise ConfigError(
            f"kafka.security.{written[0]} must not be written in the config file {path}: set it in "
            f"the environment (RTRL_KAFKA_PASSWORD, RTRL_KAFKA__SECURITY__KEY_PASSWORD) or use "
            f"kafka.security.password_file"
        )
    data = _merge(_merge(under or {}, data), _env_overrides(environ))
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        lines = [
            f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})" for err in exc.errors()
        ]
        raise ConfigError(f"invalid configuration{where}:\n" + "\n".join(lines)) from None


def to_toml(config: Config) -> str:
    """The configuration as a TOML file `load_config` reads back to the same settings: unset
    (None) values and secrets are left out (a secret belongs in the environment)."""
    data = config.model_dump(mode="json", exclude_none=True)
    for key in SECRET_FIELDS:
        data.get("kafka", {}).get("security", {}).pop(key, None)
    lines: list[str] = []

    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        return json.dumps(str(v))  # a TOML basic string is a JSON string

    def table(name: str, node: dict[str, Any]) -> None:
        scalars = {k: v for k, v in node.items() if not isinstance(v, dict)}
        if name and scalars:
            lines.append(f"\n[{name}]")
        lines.extend(f"{k} = {value(v)}" for k, v in scalars.items())
        for k, v in node.items():
            if isinstance(v, dict):
                table(f"{name}.{k}" if name else k, v)

    table("", data)
    return "\n".join(lines).lstrip() + "\n"
