"""What every command shares: the lazily loaded config and store, and error reporting."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import click
from sqlalchemy import Engine

from pipeline.core.config import Config, ConfigError, load_config
from pipeline.core.store import SchemaError, make_engine, require_current_schema

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@dataclass
class Context:
    config_path: str | None = None
    _engine: Engine | None = field(default=None, repr=False)

    @cached_property
    def config(self) -> Config:
        try:
            return load_config(self.config_path)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None

    def engine(self, check_schema: bool = True) -> Engine:
        """The store's engine; refuses a database whose schema is behind the code."""
        if self._engine is None:
            self._engine = make_engine(self.config.db_url)
        if check_schema:
            try:
                require_current_schema(self._engine)
            except SchemaError as exc:
                raise click.ClickException(str(exc)) from None
        return self._engine


pass_ctx = click.make_pass_decorator(Context)


def outcome_model(ctx: Context, spec_version: str, force: bool = False) -> Any:
    """The outcome model a command's gate uses, as a cycle gets it (train.outcome_stage.refresh:
    fitted again once enough new rewards arrived, or now with `force`; a new fit gets an MLflow run)."""
    from deploy.tracking import MlflowTracker  # (torch and mlflow: only the commands that fit)
    from train.outcome_stage import refresh

    cfg = ctx.config
    return refresh(
        ctx.engine(),
        cfg.outcome,
        cfg.train,
        spec_version,
        cfg.state_dir,
        force=force,
        make_tracker=lambda: MlflowTracker(
            cfg.tracking_uri, cfg.mlflow.experiment, cfg.artifact_root, run_name="outcome-model"
        ),
    )


def kafka_failure(config: Config, exc: BaseException, doing: str) -> click.ClickException:
    """A command's error for a Kafka client that failed: the diagnosis when there is one (it
    names the setting), else what failed where and what to check."""
    from pipeline.core.kafka_client import KafkaAccessError

    if isinstance(exc, KafkaAccessError):
        return click.ClickException(f"cannot {doing}: {exc}")
    return click.ClickException(
        f"cannot {doing} at {config.kafka_access.describe()}: {exc!r}; is the broker up (`rtrl kafka status`)?"
    )
