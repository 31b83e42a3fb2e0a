"""One validated config object: embedded defaults < TOML file < RTRL_* environment variables.

    [store]  url = "sqlite:///<state>/rtrl.db"
    [kafka]  bootstrap = "127.0.0.1:19092"
    [ingest] group_id = "rtrl-ingest", batch_max_records = 2000, ...

Environment overrides use the section and key joined by a double underscore, e.g.
`RTRL_INGEST__GROUP_ID=workers`, plus the short forms `RTRL_STATE_DIR`, `RTRL_DB_URL` and
`RTRL_KAFKA_BOOTSTRAP` that operators actually type. A bad value is refused at load time with
the field and what is allowed.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

DEFAULT_STATE_DIR = Path.home() / ".rtrl"


class ConfigError(ValueError):
    """A config value is invalid; the message names the field and what is allowed."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StoreConfig(_Section):
    url: str | None = Field(
        default=None, description="SQLAlchemy URL; default: a SQLite file in the state folder"
    )


class KafkaConfig(_Section):
    bootstrap: str | None = Field(
        default=None, description="host:port list; default: the local broker `rtrl kafka up` runs"
    )
    port: int = Field(default=19092, ge=1024, le=65535, description="local broker client port")
    controller_port: int = Field(default=19093, ge=1024, le=65535)
    version: str = Field(default="4.3.1", description="org.apache.kafka:kafka_2.13 version")
    heap: str = Field(default="512m", description="JVM heap of the local broker")
    partitions: int = Field(default=4, ge=1, le=1024, description="default partitions per topic")
    interactions_topic: str = "rtrl.interactions"
    feedback_topic: str = "rtrl.feedback"
    model_updates_topic: str = "rtrl.model-updates"

    @model_validator(mode="after")
    def _ports_differ(self) -> "KafkaConfig":
        if self.port == self.controller_port:
            raise ValueError("kafka.port and kafka.controller_port must differ")
        return self


class IngestConfig(_Section):
    group_id: str = Field(default="rtrl-ingest", min_length=1)
    topics: list[str] | None = Field(
        default=None, description="default: the interactions and feedback topics"
    )
    batch_max_records: int = Field(default=2000, ge=1, le=100_000)
    poll_timeout_ms: int = Field(default=500, ge=10, le=60_000)
    session_timeout_ms: int = Field(
        default=10_000, ge=6_000, le=300_000,
        description="a worker that dies is replaced after this long (broker allows 6s..300s)",
    )
    lanes: int = Field(
        default=1, ge=0, le=16,
        description="worker processes that decode and store, partition-affine (0 = in the consumer's process)",
    )
    max_in_flight: int = Field(default=2, ge=1, le=16, description="batches queued per lane")
    max_event_bytes: int = Field(
        default=1_048_576, ge=256, description="larger records become dead letters"
    )


class RewardConfig(_Section):
    spec: Path | None = Field(default=None, description="reward spec TOML; default: the one shipped with rtrl")


class Config(_Section):
    state_dir: Path = DEFAULT_STATE_DIR
    store: StoreConfig = StoreConfig()
    kafka: KafkaConfig = KafkaConfig()
    ingest: IngestConfig = IngestConfig()
    reward: RewardConfig = RewardConfig()

    # --- derived values: computed, never stored twice -------------------------------------
    @property
    def db_url(self) -> str:
        return self.store.url or f"sqlite:///{self.state_dir / 'rtrl.db'}"

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap or f"127.0.0.1:{self.kafka.port}"

    @property
    def ingest_topics(self) -> list[str]:
        return self.ingest.topics or [self.kafka.interactions_topic, self.kafka.feedback_topic]


_SHORT_ENV = {
    "RTRL_STATE_DIR": ("state_dir",),
    "RTRL_DB_URL": ("store", "url"),
    "RTRL_KAFKA_BOOTSTRAP": ("kafka", "bootstrap"),
}


def _env_overrides(environ: dict[str, str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name, value in environ.items():
        if name in _SHORT_ENV:
            path = _SHORT_ENV[name]
        elif name.startswith("RTRL_") and "__" in name:
            path = tuple(part.lower() for part in name[len("RTRL_"):].split("__"))
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


def load_config(path: str | Path | None = None, environ: dict[str, str] | None = None) -> Config:
    """Load the config: defaults, then the TOML file (if any), then RTRL_* variables."""
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
    data = _merge(data, _env_overrides(environ))
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        where = f" in {path}" if path else ""
        lines = [
            f"  {'.'.join(str(p) for p in err['loc'])}: {err['msg']} (got {err.get('input')!r})"
            for err in exc.errors()
        ]
        raise ConfigError(f"invalid configuration{where}:\n" + "\n".join(lines)) from None
