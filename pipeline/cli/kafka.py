"""`rtrl kafka`: the local single-node Kafka broker for development, the demo and tests."""

from __future__ import annotations

import click
from kafka.errors import KafkaError

from pipeline import kafka_local, kafka_secure
from pipeline.cli.common import CONTEXT_SETTINGS, Context, pass_ctx
from pipeline.core.kafka_config import security_env


@click.group(context_settings=CONTEXT_SETTINGS)
def kafka() -> None:
    """Run a real Apache Kafka (KRaft, single node) on 127.0.0.1 under the state folder.

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
