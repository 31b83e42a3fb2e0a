"""`rtrl daemon`: the loop as a service (ingest continuously, cycles on a schedule)."""

from __future__ import annotations

import signal
import threading

import click

from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx
from pipeline.cli.reward import SPEC_OPTION, reward_spec


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option("--metrics-port", default=9108, show_default=True, help="/metrics (Prometheus) and /health.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True)
@click.option(
    "--lease-ttl",
    default=60.0,
    show_default=True,
    help="Seconds a dead daemon keeps the cycle lease before another takes over.",
)
@click.option("--no-ingest", is_flag=True, help="Run cycles only (ingest runs elsewhere).")
@SPEC_OPTION
@pass_ctx
def daemon(
    ctx: Context, metrics_port: int, metrics_host: str, lease_ttl: float, no_ingest: bool, spec_path: str | None
) -> None:
    """Ingest continuously and run reward -> train -> gate -> promote every `cycle.every`.

    Several daemons may run against one store: all ingest (the consumer group shares the
    partitions), exactly one runs cycles (a lease in the store; another takes over within
    --lease-ttl when it dies). SIGTERM drains ingest and stops; an interrupted cycle resumes
    from its state on the next start.
    """
    from pipeline.core.logs import quiet_progress_bars
    from pipeline.cycle import default_deps
    from pipeline.daemon import Daemon
    from train.models import ModelError

    quiet_progress_bars()
    engine = ctx.engine()  # refuses a store whose schema is behind
    config = ctx.config
    try:
        deps = default_deps(config, engine, reward_spec(ctx, spec_path))
    except ModelError as exc:
        raise click.ClickException(f"train.base_model: {exc}") from None
    d = Daemon(config, deps, lease_ttl_s=lease_ttl)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    d.start(ingest=not no_ingest, metrics_port=metrics_port, host=metrics_host)
    click.echo(
        f"rtrl daemon {d.owner}: cycles every {config.cycle.every}; metrics on "
        f"http://{metrics_host}:{metrics_port}/metrics",
        err=True,
    )
    stopped.wait()
    d.shutdown()
