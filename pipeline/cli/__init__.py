"""`rtrl` — the command line. Commands mirror nouns; each parses, calls one function, prints.

rtrl kafka up|down|status      the local Kafka broker (--secure: SASL_SSL, as managed Kafka)
rtrl kafka topics create|check the loop's topics on any broker, with the settings it relies on
rtrl db upgrade|current        schema migrations
rtrl ingest                    consume events into the store (exactly once)
rtrl replay                    re-feed history: from Kafka by time, from a file, dead letters
rtrl dead-letters list|show|replay   the records ingest set aside
rtrl export                    write stored events out as NDJSON(.gz)
rtrl status                    lag, table counts, dead letters
rtrl reward run|explain|diff|recompute|audit|model   rewards from delayed outcomes
rtrl model init-tiny|show      base models (local directories)
rtrl train run|show            LoRA updates from rewarded episodes, tracked in MLflow
rtrl gate [RUN]                register a run's adapter, evaluate it against the champion, decide
rtrl models list|show          registry versions, decisions, alias moves
rtrl promote VERSION | rollback   move the champion alias (audited; serving follows)
rtrl serve                     the reference policy server (or --vllm URL: keep vLLM on the champion)
rtrl daemon                    ingest continuously, run cycles on a schedule (one daemon at a time)
rtrl demo [--naive-reward]     the whole loop on a laptop, with a simulated fleet and a report
rtrl sim                       the simulated fleet alone, against a running `rtrl serve`
rtrl gateway                   capture and route requests in front of vLLM (or rtrl serve)
"""

from __future__ import annotations

import sys

import click

from pipeline.cli import daemon as daemon_cmds
from pipeline.cli import db as db_cmds
from pipeline.cli import dead_letters as dead_letter_cmds
from pipeline.cli import demo as demo_cmds
from pipeline.cli import deploy as deploy_cmds
from pipeline.cli import events as event_cmds
from pipeline.cli import gateway as gateway_cmds
from pipeline.cli import kafka as kafka_cmds
from pipeline.cli import model as model_cmds
from pipeline.cli import reward as reward_cmds
from pipeline.cli import train as train_cmds
from pipeline.cli.common import CONTEXT_SETTINGS, Context, Group
from pipeline.core.logs import setup_logging


@click.group(cls=Group, context_settings=CONTEXT_SETTINGS)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    envvar="RTRL_CONFIG",
    help="TOML config file (default: embedded defaults; RTRL_* variables override).",
)
@click.option(
    "--log-level",
    default="INFO",
    show_default=True,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="Structured (JSON) log level on stderr.",
)
@click.pass_context
def cli(ctx: click.Context, config_path: str | None, log_level: str) -> None:
    """rtrl: a real-time RL loop that learns from production feedback.

    Events stream through Kafka into a store; rewards, LoRA training, gating and promotion
    follow on a schedule. Start with `rtrl kafka up`, `rtrl db upgrade`, `rtrl ingest`.
    """
    setup_logging(log_level)
    ctx.obj = Context(config_path)


cli.add_command(kafka_cmds.kafka)
cli.add_command(db_cmds.db)
cli.add_command(reward_cmds.reward)
cli.add_command(model_cmds.model)
cli.add_command(train_cmds.train)
cli.add_command(daemon_cmds.daemon)
for group in (event_cmds, dead_letter_cmds, deploy_cmds, gateway_cmds, demo_cmds):
    for command in group.COMMANDS:
        cli.add_command(command)


def main() -> None:
    cli(prog_name="rtrl")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
