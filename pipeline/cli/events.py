"""`rtrl ingest | replay | export | status`: getting events into the store and looking at it."""

from __future__ import annotations

import signal
import sys
import threading
from datetime import UTC, datetime

import click

from ingest.consumer import run_ingest
from ingest.lag import KafkaError, partition_lag
from ingest.ndjson import export_events
from ingest.progress import IngestDisplay
from ingest.replay import replay_dead_letters, replay_from_file, replay_from_kafka
from pipeline.cli.common import CONTEXT_SETTINGS, Context, kafka_failure, pass_ctx
from pipeline.core.config import Config
from pipeline.core.store.cycles import recent_cycles
from pipeline.core.store.event_reads import dead_letters_by_reason, table_counts
from pipeline.core.store.events import utcnow
from pipeline.core.store.leases import holder
from train.outcome_record import gate_use
from train.outcome_record import latest as latest_outcome_model


def _stop_on_signals() -> threading.Event:
    """SIGTERM/SIGINT ask the loop to finish its batch, commit and exit; a second one kills."""
    stop = threading.Event()

    def handler(signum, _frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--max-records", type=int, default=None, help="Stop after this many records (default: run until stopped)."
)
@click.option(
    "--idle-exit", type=float, default=None, metavar="SECONDS", help="Stop after this many seconds without new records."
)
@click.option(
    "--until-caught-up",
    is_flag=True,
    help="Stop once every record the partitions held is stored (a backfill or batch catch-up).",
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Live display of events/s, lag and dead letters (default: when stdout is a terminal).",
)
@click.option(
    "--from",
    "start",
    type=click.Choice(["earliest", "latest"]),
    default=None,
    help="Where partitions the store has no offset for start: the beginning of retention (default, "
    "ingest.start) or only new records. Partitions the store has offsets for continue from them.",
)
@pass_ctx
def ingest(
    ctx: Context,
    max_records: int | None,
    idle_exit: float | None,
    until_caught_up: bool,
    progress: bool | None,
    start: str | None,
) -> None:
    """Consume the event topics into the store, exactly once.

    Joins the consumer group `ingest.group_id`; several `rtrl ingest` processes share the
    partitions. Each batch's events, dead letters and next offsets are stored in one
    transaction, then the offsets are committed to Kafka. SIGTERM or Ctrl-C finishes the
    batch in hand and exits cleanly; a restart continues exactly where the store is.
    """
    cfg, engine = ctx.config, ctx.engine()
    if start is not None:
        cfg.ingest.start = start
    stop = _stop_on_signals()
    show = sys.stdout.isatty() if progress is None else progress
    display = IngestDisplay(enabled=show)
    with display:
        try:
            stats = run_ingest(
                cfg,
                engine,
                stop,
                on_batch=display.update,
                max_records=max_records,
                idle_exit_s=idle_exit,
                until_caught_up=until_caught_up,
            )
        except KafkaError as exc:
            raise kafka_failure(cfg, exc, "consume") from None
    click.echo(
        f"ingested {stats.events} events ({stats.duplicates} duplicates skipped, "
        f"{stats.dead_letters} dead letters) in {stats.batches} batches"
    )


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--since",
    type=click.DateTime(["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M:%S%z"]),
    help="From Kafka: first record time (UTC unless an offset is given). Default: the beginning.",
)
@click.option(
    "--until",
    type=click.DateTime(["%Y-%m-%d", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M:%S%z"]),
    help="From Kafka: stop before this record time. Default: the end as of now.",
)
@click.option("--topic", "topics", multiple=True, help="From Kafka: topic(s) to replay (default: the ingest topics).")
@click.option("--file", "path", type=str, help="Replay an NDJSON(.gz) file instead of Kafka ('-' for stdin).")
@click.option(
    "--dead-letters",
    is_flag=True,
    help="Retry the stored dead letters (after a fix); those that pass are stored and removed.",
)
@click.option("--dry-run", is_flag=True, help="Decode and compare with the store, write nothing.")
@pass_ctx
def replay(ctx: Context, since, until, topics, path, dead_letters: bool, dry_run: bool) -> None:
    """Re-feed history into the store, without touching the live consumer group.

    \b
    From Kafka by time:   rtrl replay --since 2026-11-01 --until 2026-11-02
    From a file:          rtrl replay --file events.ndjson.gz
    Retry dead letters:   rtrl replay --dead-letters

    Idempotent: events already stored (same event_id) are skipped, so replaying twice changes
    nothing. Use --dry-run to see what would change first.
    """
    if path and dead_letters:
        raise click.UsageError("choose one of --file and --dead-letters")
    if (path or dead_letters) and (since or until or topics):
        raise click.UsageError("--since/--until/--topic apply to replays from Kafka only")
    cfg, engine = ctx.config, ctx.engine()
    since, until = _utc(since), _utc(until)
    if since and until and since >= until:
        raise click.UsageError(f"--since ({since}) must be before --until ({until})")
    if dead_letters:
        report = replay_dead_letters(cfg, engine, dry_run=dry_run)
    elif path:
        try:
            report = replay_from_file(cfg, engine, path, dry_run=dry_run)
        except FileNotFoundError:
            raise click.ClickException(f"{path} does not exist") from None
        except OSError as exc:  # e.g. a truncated .gz file
            raise click.ClickException(f"cannot read {path}: {exc}") from None
    else:
        try:
            report = replay_from_kafka(cfg, engine, since, until, topics or None, dry_run=dry_run)
        except KafkaError as exc:
            raise kafka_failure(cfg, exc, "replay from Kafka") from None
    click.echo(("dry run: " if dry_run else "") + report.summary())


@click.command(context_settings=CONTEXT_SETTINGS)
@click.argument("path")
@pass_ctx
def export(ctx: Context, path: str) -> None:
    """Write every stored event to PATH as NDJSON (gzip when PATH ends in .gz; '-' for stdout).

    The output replays into an empty store with `rtrl replay --file PATH` and gives the same
    events back.
    """
    n = export_events(ctx.engine(), path)
    if path != "-":
        click.echo(f"exported {n} events to {path}")


def _outcome_model_line(cfg: Config) -> str:
    g = cfg.gate
    if not cfg.outcome.enabled:
        return (
            f"outcome model: off (outcome.enabled = false); {gate_use(False, g.estimator, g.fresh_prompts, g.fallback)}"
        )
    try:
        m = latest_outcome_model(cfg.state_dir)
    except ValueError as exc:
        return f"outcome model: {exc}"
    if m is None:
        return (
            f"outcome model: none yet (a cycle fits one once {cfg.outcome.min_episodes} rewarded episodes "
            f"can be); {gate_use(False, g.estimator, g.fresh_prompts, g.fallback)}"
        )
    q = m["quality"]
    return (
        f"outcome model: {gate_use(m['usable'], g.estimator, g.fresh_prompts, g.fallback)}; AUROC "
        f"{q['auroc']:.3f}, calibration error {q['calibration_error']:.3f}, fitted {m.get('fitted_at', '?')} on "
        f"{sum(m['episodes'].values())} episodes (`rtrl reward model show`)"
    )


@click.command(context_settings=CONTEXT_SETTINGS)
@pass_ctx
def status(ctx: Context) -> None:
    """Print row counts per table, dead letters by reason, the last cycles (a canary waiting on
    live traffic among them) and who runs them, and lag per partition."""
    cfg, engine = ctx.config, ctx.engine()
    click.echo(f"store: {engine.url.render_as_string(hide_password=True)}")
    for name, count in table_counts(engine).items():
        click.echo(f"  {name:<18} {count:>10}")
    reasons = dead_letters_by_reason(engine)
    click.echo("dead letters by reason:" + ("" if reasons else " none"))
    for reason, count in sorted(reasons.items()):
        click.echo(f"  {reason:<28} {count:>8}")
    lease = holder(engine, "cycle")
    held = lease is not None and lease.expires_at > utcnow()
    click.echo(
        "cycles"
        + (
            f" (run by {lease.owner}, lease until {lease.expires_at:%Y-%m-%d %H:%M:%S} UTC):"
            if held
            else " (no daemon holds the lease):"
        )
    )
    for c in recent_cycles(engine, 5):
        candidate = f" v{c.candidate_version}" if c.candidate_version else ""
        line = f"  {c.started_at:%Y-%m-%d %H:%M:%S} {c.cycle_id} {c.state:<10}{candidate}  {c.reason or ''}"
        # a canary's reason is its test's progress, read whole; an ended cycle's reason is cut
        # to a line (`rtrl models show` has its decision)
        click.echo(line if c.state == "canary" else line[:200])
    click.echo(_outcome_model_line(cfg))
    click.echo(f"lag for group {cfg.ingest.group_id} at {cfg.kafka_access.describe()}:")
    try:
        lags = partition_lag(cfg, engine, timeout_ms=5000)
    except KafkaError as exc:
        click.echo(f"  {kafka_failure(cfg, exc, 'read the lag').message}")
        return
    if not lags:
        click.echo("  no partitions (topics not created yet)")
    width = max((len(f"{pl.topic}[{pl.partition}]") for pl in lags), default=0)
    for pl in lags:
        stored = "-" if pl.stored is None else pl.stored
        name = f"{pl.topic}[{pl.partition}]"
        click.echo(f"  {name:<{width}}  stored {stored:>10}  end {pl.end:>10}  lag {pl.lag:>8}")
    click.echo(f"  total lag {sum(pl.lag for pl in lags)}")


COMMANDS = [ingest, replay, export, status]
