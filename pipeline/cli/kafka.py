"""`rtrl kafka`: the local single-node Kafka broker for development, the demo and tests, and
`rtrl kafka topics create|check` for any broker (managed Kafka)."""

from __future__ import annotations

import click
from kafka.errors import KafkaError

from pipeline import kafka_local, kafka_secure
from pipeline.cli.common import CONTEXT_SETTINGS, Context, kafka_failure, pass_ctx
from pipeline.core.decision_config import DURATION, duration_s
from pipeline.core.kafka_config import security_env


@click.group(context_settings=CONTEXT_SETTINGS)
def kafka() -> None:
    """Run a real Apache Kafka (KRaft, single node) on 127.0.0.1 under the state folder, or
    create and check the loop's topics on any broker (`rtrl kafka topics`).

    The broker jars come from Maven Central on first use (needs Java 17+ and Maven).
    """


@kafka.command()
@click.option(
    "--secure",
    is_flag=True,
    help="A SASL_SSL listener (TLS with a client certificate, then a SCRAM/PLAIN login), as managed "
    "Kafka runs; chosen when the broker is first set up, and kept.",
)
@pass_ctx
def up(ctx: Context, secure: bool) -> None:
    """Start the broker (fetch, format, start, wait until ready) and create the topics.

    With --secure, the settings rtrl's clients need are printed (never the password: it is in a
    0600 file under the state folder).
    """
    cfg = ctx.config
    try:
        broker = kafka_local.up(cfg, progress=click.echo, secure=secure)
        kafka_local.ensure_topics(
            broker.access(),
            [cfg.kafka.interactions_topic, cfg.kafka.feedback_topic, cfg.kafka.model_updates_topic],
            cfg.kafka.partitions,
        )
    except (kafka_local.KafkaLocalError, kafka_secure.KafkaSecureError, KafkaError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"kafka is up: bootstrap {broker.access().describe()}")
    if broker.secure:
        click.echo("clients connect with these settings (environment; or [kafka.security] in the config file):")
        for name, value in security_env(broker.access().security).items():
            click.echo(f"  export {name}={value}")


@kafka.command()
@pass_ctx
def down(ctx: Context) -> None:
    """Stop the broker (data stays under the state folder)."""
    click.echo("kafka stopped" if kafka_local.down(ctx.config) else "kafka was not running")


@kafka.command()
@pass_ctx
def status(ctx: Context) -> None:
    """Say whether the local broker runs, where, and where its logs are."""
    broker = kafka_local.LocalBroker.from_config(ctx.config)
    pid = broker.pid()
    if pid is None:
        click.echo("kafka: not running (start it with `rtrl kafka up`)")
        raise SystemExit(1)
    state = "serving" if broker.accepting() else "starting"
    click.echo(f"kafka: {state}, pid {pid}, bootstrap {broker.access().describe()}, logs {broker.log_file}")


def _retention_ms(value: str) -> int:
    if not DURATION.fullmatch(value.strip()):
        raise click.BadParameter(f"a duration such as 7d, 36h (got {value!r})")
    return int(duration_s(value) * 1000)


@kafka.group()
def topics() -> None:
    """The loop's three topics on the broker kafka.bootstrap names -- for a broker rtrl did not
    start (managed Kafka): create them with the settings the loop relies on, or check them.

    \b
    cleanup.policy     delete (compaction drops feedback that shares a request's key)
    retention.ms       >= --min-retention (7d): an ingest outage or a replay reads it back
    max.message.bytes  >= kafka.max_message_bytes: what producers may send
    replication        >= --min-replication; min.insync.replicas >= 2 with 3 replicas (acks=all)
    partitions         kafka.partitions at creation; fewer limits ingest's parallelism
    """


@topics.command()
@click.option("--replication-factor", "replication", type=click.IntRange(1, 16), help="Default: min(3, brokers).")
@click.option("--retention", default="7d", show_default=True, help="retention.ms of the new topics, e.g. 30d.")
@pass_ctx
def create(ctx: Context, replication: int | None, retention: str) -> None:
    """Create the topics that do not exist (partitions: kafka.partitions); existing ones are left
    as they are -- `rtrl kafka topics check` says whether they will do."""
    from pipeline import kafka_topics

    cfg = ctx.config
    try:
        made, there = kafka_topics.create(cfg, replication, _retention_ms(retention))
    except KafkaError as exc:
        raise kafka_failure(cfg, exc, "create the topics") from None
    for name in made:
        click.echo(f"created {name}")
    for name in there:
        click.echo(f"exists  {name} (left as it is)")


@topics.command()
@click.option("--min-replication", default=1, show_default=True, type=click.IntRange(1, 16))
@click.option("--min-retention", default="7d", show_default=True, help="Shortest retention.ms accepted.")
@pass_ctx
def check(ctx: Context, min_replication: int, min_retention: str) -> None:
    """Check each topic the loop uses: exit 0 when all will do, 1 naming each setting that does not."""
    from pipeline import kafka_topics

    cfg = ctx.config
    try:
        found = kafka_topics.check(cfg, min_replication, _retention_ms(min_retention))
    except KafkaError as exc:
        raise kafka_failure(cfg, exc, "describe the topics") from None
    for t in found:
        shape = f"{t.partitions} partitions, replication {t.replication}" if t.exists else "missing"
        click.echo(f"{'ok  ' if not t.problems else 'FAIL'} {t.name} ({t.role}): {shape}")
        for line in t.problems:
            click.echo(f"       - {line}")
        for line in t.notes:
            click.echo(f"       note: {line}")
    if any(t.problems for t in found):
        raise SystemExit(1)
