"""`rtrl kafka`: the local single-node Kafka broker for development, the demo and tests."""

from __future__ import annotations

import click

from pipeline import kafka_local
from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx


@click.group(context_settings=CONTEXT_SETTINGS)
def kafka() -> None:
    """Run a real Apache Kafka (KRaft, single node) on 127.0.0.1 under the state folder.

    The broker jars come from Maven Central on first use (needs Java 17+ and Maven).
    """


@kafka.command()
@pass_ctx
def up(ctx: Context) -> None:
    """Start the broker (fetch, format, start, wait until ready) and create the topics."""
    cfg = ctx.config
    try:
        broker = kafka_local.up(cfg, progress=click.echo)
        kafka_local.ensure_topics(
            broker.bootstrap,
            [cfg.kafka.interactions_topic, cfg.kafka.feedback_topic, cfg.kafka.model_updates_topic],
            cfg.kafka.partitions,
        )
    except kafka_local.KafkaLocalError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"kafka is up: bootstrap {broker.bootstrap}")


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
    click.echo(f"kafka: {state}, pid {pid}, bootstrap {broker.bootstrap}, logs {broker.log_file}")
