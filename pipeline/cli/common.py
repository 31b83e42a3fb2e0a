"""What every command shares: the lazily loaded config and store, and error reporting."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import click
from sqlalchemy import Engine
from sqlalchemy.exc import InterfaceError, OperationalError

from pipeline.core.config import Config, ConfigError, load_config
from pipeline.core.logs import mask_uri, redacted_uri, scrub
from pipeline.core.store import SchemaError, StoreAccessError, make_engine, require_current_schema, store_failure

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


@dataclass
class Context:
    config_path: str | None = None
    _engine: Engine | None = field(default=None, repr=False)

    @cached_property
    def config(self) -> Config:
        try:
            config = load_config(self.config_path)
            for uri in (config.db_url, config.tracking_uri):  # out of every log line and error
                mask_uri(uri)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        return config

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
log = logging.getLogger("rtrl.cli")


class Group(click.Group):
    """The top-level group. A store or MLflow tracking server that cannot be reached or opened
    is one line naming its setting and what to check, as a broker is (`kafka_failure`), in place
    of a library's traceback (--log-level DEBUG logs the traceback too)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except StoreAccessError as exc:
            raise _one_line(exc, str(exc)) from None
        except (OperationalError, InterfaceError) as exc:  # the connection's, not a query's, failures
            raise _one_line(exc, str(store_failure(_store_url(ctx), exc))) from None
        except Exception as exc:
            mlflow_errors = sys.modules.get("mlflow.exceptions")  # loaded only by the commands that use it
            if mlflow_errors is None or not isinstance(exc, mlflow_errors.MlflowException):
                raise
            raise _one_line(exc, tracking_failure(_config(ctx), exc)) from None


def _one_line(exc: BaseException, message: str) -> click.ClickException:
    log.debug("command failed", exc_info=exc)
    return click.ClickException(scrub(message))


def _config(ctx: click.Context) -> Config | None:
    obj = ctx.obj
    try:
        return obj.config if isinstance(obj, Context) else None
    except click.ClickException:
        return None


def _store_url(ctx: click.Context) -> str:
    obj = ctx.obj
    if isinstance(obj, Context) and obj._engine is not None:
        return obj._engine.url.render_as_string(hide_password=False)
    config = _config(ctx)
    return config.db_url if config else "(unknown)"


def tracking_failure(config: Config | None, exc: BaseException) -> str:
    """One line for an MLflow call that failed: the tracking URI (credentials masked), MLflow's
    first line, and what to check."""
    text = str(getattr(exc, "message", None) or exc).strip()
    detail = text.splitlines()[0] if text else type(exc).__name__
    where = redacted_uri(config.tracking_uri) if config else "(unknown)"
    return f"MLflow at {where}: {detail}; check mlflow.tracking_uri and that the tracking server is up"


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
