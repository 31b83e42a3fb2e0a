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
import tomllib
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator

from pipeline.core.config_section import Section as _Section
from pipeline.core.decision_config import (  # noqa: F401 - re-exported
    DURATION,
    Bound,
    GateConfig,
    OutcomeConfig,
    RolloutConfig,
    duration_s,
)
from pipeline.core.kafka_config import SECRET_FIELDS, KafkaAccess, KafkaConfig
from pipeline.core.logs import redacted_uri
from pipeline.core.train_config import LossName, TrainConfig  # noqa: F401 - re-exported

DEFAULT_STATE_DIR = Path.home() / ".rtrl"


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and what is allowed."""


class StoreConfig(_Section):
    url: str | None = Field(
        default=None,
        description="SQLAlchemy URL; default: a SQLite file in the state folder. Its password: only from the "
        "environment (RTRL_DB_URL, RTRL_DB_PASSWORD) or password_file",
    )
    password: SecretStr | None = Field(
        default=None, description="only from the environment: RTRL_DB_PASSWORD (or use password_file)"
    )
    password_file: Path | None = Field(
        default=None, description="a file holding the store's password (one line), e.g. a mounted secret"
    )

    @model_validator(mode="after")
    def _one_password(self) -> StoreConfig:
        if self.password is not None and self.password_file is not None:
            raise ValueError("store: give the password once, RTRL_DB_PASSWORD or store.password_file")
        if (self.password is not None or self.password_file is not None) and not self.url:
            raise ValueError("store.password/password_file need store.url (the server they are for)")
        if self.password_file is not None and not self.password_file.is_file():
            raise ValueError(f"store.password_file: {self.password_file} is not a readable file")
        return self


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
        """The store's URL, with its password when one is given apart (RTRL_DB_PASSWORD,
        store.password_file): what engines connect with; print it through redacted_uri."""
        url = self.store.url or f"sqlite:///{self.state_dir / 'rtrl.db'}"
        s = self.store
        if s.password is not None:
            return with_password(url, s.password.get_secret_value())
        if s.password_file is not None:
            try:
                secret = s.password_file.read_text().rstrip("\r\n")
            except OSError as exc:
                raise ConfigError(f"store.password_file {s.password_file} cannot be read: {exc.strerror}") from None
            return with_password(url, secret)
        return url

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


def with_password(url: str, password: str) -> str:
    """`url` with `password` in its userinfo (percent-encoded, as SQLAlchemy reads it)."""
    parts = urlsplit(url)
    if not parts.username:
        raise ConfigError(f"store.url {redacted_uri(url)} names no user for the password to go with: USER@HOST")
    netloc = f"{parts.username}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _secrets_in_file(data: dict[str, Any], path: str | Path | None) -> str | None:
    """The first secret written in the config file, as an error; None when there is none. One
    policy for every secret: it comes from the environment or a file, never from rtrl.toml."""
    written = [k for k in SECRET_FIELDS if k in data.get("kafka", {}).get("security", {})]
    if written:
        return (
            f"kafka.security.{written[0]} must not be written in the config file {path}: set it in "
            f"the environment (RTRL_KAFKA_PASSWORD, RTRL_KAFKA__SECURITY__KEY_PASSWORD) or use "
            f"kafka.security.password_file"
        )
    store = data.get("store", {})
    if "password" in store:
        return f"store.password must not be written in the config file {path}: RTRL_DB_PASSWORD or store.password_file"
    if isinstance(store.get("url"), str) and urlsplit(store["url"]).password is not None:
        return (
            f"store.url in the config file {path} holds a password: leave it out of the URL "
            f"({redacted_uri(store['url']).replace(':***@', '@')}) and use store.password_file or RTRL_DB_PASSWORD "
            "(or give the whole URL as RTRL_DB_URL)"
        )
    uri = data.get("mlflow", {}).get("tracking_uri")
    if isinstance(uri, str) and urlsplit(uri).password is not None:
        return (
            f"mlflow.tracking_uri in the config file {path} holds a password: leave it out and set MLflow's own "
            "MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN), or give the URI as "
            "RTRL_MLFLOW__TRACKING_URI"
        )
    return None


_SHORT_ENV = {
    "RTRL_STATE_DIR": ("state_dir",),
    "RTRL_DB_URL": ("store", "url"),
    "RTRL_DB_PASSWORD": ("store", "password"),
    "RTRL_KAFKA_BOOTSTRAP": ("kafka", "bootstrap"),
    "RTRL_KAFKA_PASSWORD": ("kafka", "security", "password"),
}


def _env_overrides(environ: dict[str, str]) -> tuple[dict[str, Any], dict[tuple[str, ...], str]]:
    """RTRL_* variables as a nested dict, and which variable set each path (for error messages).
    A value that starts with `[` or `{` is JSON (a list or a table: RTRL_GATE__BOUNDS='{"kl":
    {"max": 1.0}}'); `topics` also takes a comma-separated list; anything else is text that the
    config's types convert."""
    overrides: dict[str, Any] = {}
    sources: dict[tuple[str, ...], str] = {}
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
        if value.lstrip()[:1] in ("[", "{"):
            try:
                node[path[-1]] = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{name}: a value that starts with {value.lstrip()[0]!r} is read as JSON, and this is "
                    f'not valid JSON ({exc.msg} at character {exc.pos}); e.g. {name}=\'["a", "b"]\''
                ) from None
        else:
            node[path[-1]] = [part.strip() for part in value.split(",")] if path[-1] == "topics" else value
        sources[path] = name
    return overrides, sources


def _where(loc: tuple[Any, ...], sources: dict[tuple[str, ...], str], path: str | Path | None) -> str:
    """Where a wrong value came from: the variable that set it (or a table above it), else the file."""
    keys = tuple(str(part) for part in loc)
    for n in range(len(keys), 0, -1):
        if keys[:n] in sources:
            return f" (from {sources[keys[:n]]})"
    return f" (in {path})" if path else ""


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
    refused = _secrets_in_file(data, path)
    if refused:
        raise ConfigError(refused)
    overrides, sources = _env_overrides(environ)
    data = _merge(_merge(under or {}, data), overrides)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        lines = [
            f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
            + _where(err["loc"], sources, path)
            for err in exc.errors()
        ]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines)) from None


def _without_password(url: str) -> str:
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def to_toml(config: Config) -> str:
    """The configuration as a TOML file `load_config` reads back to the same settings: unset
    (None) values and secrets are left out (a secret belongs in the environment)."""
    data = config.model_dump(mode="json", exclude_none=True)
    for key in SECRET_FIELDS:
        data.get("kafka", {}).get("security", {}).pop(key, None)
    data.get("store", {}).pop("password", None)
    for section, key in (("store", "url"), ("mlflow", "tracking_uri")):  # a URL's password stays out too
        if isinstance(data.get(section, {}).get(key), str):
            data[section][key] = _without_password(data[section][key])
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
