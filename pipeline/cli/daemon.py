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
@click.option(
    "--once",
    is_flag=True,
    help="Ingest until caught up, run one cycle, exit (cron, a Kubernetes CronJob); the exit code says what happened.",
)
@SPEC_OPTION
@pass_ctx
def daemon(
    ctx: Context,
    metrics_port: int,
    metrics_host: str,
    lease_ttl: float,
    no_ingest: bool,
    once: bool,
    spec_path: str | None,
) -> None:
    """Ingest continuously and run reward -> train -> gate -> promote every `cycle.every`.

    Several daemons may run against one store: all ingest (the consumer group shares the
    partitions), exactly one runs cycles (a lease in the store; another takes over within
    --lease-ttl when it dies). SIGTERM drains ingest and stops; an interrupted cycle resumes
    from its state on the next start.

    With --once: store what the topics hold, take the lease, run or resume one cycle, release
    the lease and exit: 0 when the loop did its job (promoted, rejected, skipped, or a canary
    waiting on traffic, looked at again by the next run), 1 a stage failed, 3 the store could
    not be written, 4 another daemon holds the cycle lease, 5 the lease was taken over
    mid-cycle, 6 stopped by a signal (the next run resumes). Settings are read at every run;
    a running daemon reads them at start (restart it after a change).
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
    if once:
        _once(d, ingest=not no_ingest)
        return
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


def _once(d, ingest: bool) -> None:
    from ingest.lag import KafkaError
    from pipeline.cli.common import kafka_failure
    from pipeline.once import run_once

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: d.stop.set())
    try:
        result = run_once(d, ingest=ingest)
    except KafkaError as exc:  # step 1: no cycle runs on a store that may be behind the topics
        raise kafka_failure(d.config, exc, "ingest before the cycle (--no-ingest runs the cycle alone)") from None
    cycle = result.cycle
    head = f"cycle {cycle['cycle_id']}" if cycle.get("cycle_id") else "no cycle"
    details = [str(cycle["reason"])] if cycle.get("reason") else []
    if result.ingested is not None:
        details.append(f"{result.ingested} events ingested first")
    click.echo(f"{head}: {result.outcome}" + "".join(f"; {d}" for d in details))
    click.get_current_context().exit(result.exit_code)
