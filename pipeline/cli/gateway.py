"""`rtrl gateway`: the loop's capture in front of an OpenAI-compatible model server."""

from __future__ import annotations

import os
import threading

import click

from pipeline.cli.common import CONTEXT_SETTINGS, Context, kafka_failure, pass_ctx


@click.command(context_settings=CONTEXT_SETTINGS)
@click.option(
    "--upstream",
    required=True,
    help="The model server's base URL (vLLM, SGLang, rtrl serve), e.g. http://127.0.0.1:8000.",
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True)
@click.option("--tenant", default="default", show_default=True, help="Tenant of requests without X-Tenant.")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True, help="Seconds to wait for the upstream.")
@click.option(
    "--poll",
    "poll_s",
    default=2.0,
    show_default=True,
    help="Seconds between reads of the upstream's /v1/models: a version the registry moved to is "
    "routed to once the upstream lists it.",
)
@click.option(
    "--allow-raw-logprobs",
    is_flag=True,
    help="Start even when the upstream returns raw log-probs (vLLM's default): answers sampled at "
    "other than temperature 1 without top-k/top-p are then kept without their log-probs.",
)
@click.option("--max-body-bytes", default=16 << 20, show_default=True, help="The largest request body (413 above).")
@click.option(
    "--body-timeout",
    "body_timeout_s",
    default=30.0,
    show_default=True,
    help="Seconds a request body may take to arrive (408 after).",
)
@pass_ctx
def gateway(
    ctx: Context,
    upstream: str,
    host: str,
    port: int,
    tenant: str,
    timeout_s: float,
    poll_s: float,
    allow_raw_logprobs: bool,
    max_body_bytes: int,
    body_timeout_s: float,
) -> None:
    """Proxy /v1/chat/completions, /v1/completions and /v1/models to UPSTREAM, routing each request
    to the registry's champion (or its canary's share) and sending an interaction event for every
    answer; POST /v1/feedback takes the application's outcomes (and POST /v1/interactions the
    answers of an application that serves itself) with the token in RTRL_GATEWAY_TOKEN as
    'Authorization: Bearer <token>' -- off when it is unset. Events wait in a local spool while
    Kafka is away."""
    import uvicorn
    from prometheus_client import Gauge

    from deploy.registry import Registry
    from deploy.serving.events import FEEDBACK_KEY, EventSender
    from deploy.serving.follow import Follower, current
    from deploy.serving.gateway import Gateway
    from deploy.serving.gateway_api import create_gateway_app
    from deploy.serving.gateway_sampling import LOGPROBS_FLAG
    from pipeline.core.logs import mask
    from pipeline.core.spool import Spool

    config = ctx.config
    spool_dir = config.state_dir / "spool" / f"gateway-{port}"

    def sender(topic: str, part: str, key: str | tuple[str, ...]) -> EventSender:
        # write-ahead: an event is in the spool (fsynced within its commit interval) before it is
        # sent, so a gateway killed under load loses at most that interval's events
        return EventSender(
            config.kafka_access,
            topic,
            key=key,
            timeout_s=10.0,
            write_ahead=True,
            spool=Spool(spool_dir / part, config.spool.max_bytes, config.spool.when_full),
        )

    interactions = sender(config.kafka.interactions_topic, "interactions", "request_id")
    feedback = sender(config.kafka.feedback_topic, "feedback", FEEDBACK_KEY)
    token = os.environ.get("RTRL_GATEWAY_TOKEN") or None  # the ingestion routes' credential: never logged
    if token:
        mask(token)
    secret = os.environ.get("RTRL_ROUTING_SECRET", "")  # shared by every replica and rtrl serve behind
    if secret:
        mask(secret)
    else:
        click.echo(
            "warning: RTRL_ROUTING_SECRET is unset: this gateway salts the canary's hash with a secret of "
            "its own -- give every replica (and an rtrl serve behind it) the same one",
            err=True,
        )
    gw = Gateway(
        upstream,
        config.mlflow.registered_model,
        interactions,
        feedback,
        tenant,
        timeout_s,
        blocking=config.spool.when_full == "block",
        ingest_token=token,
        routing_secret=secret,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
    )
    Gauge(
        "rtrl_gateway_events_set_aside",
        "Events the broker refused for good (too large for the topic), kept in the spool's set-aside.jsonl",
        registry=gw.metrics,
    ).set_function(lambda: interactions.spool.set_aside + feedback.spool.set_aside)
    registry = Registry(config.tracking_uri, config.mlflow.registered_model, None)
    try:
        follower = Follower(
            config.kafka_access,
            config.kafka.model_updates_topic,
            config.mlflow.registered_model,
            gw.on_update,
            lambda alias: current(registry, alias),
            aliases=("champion", "canary"),
        )
        for alias in ("champion", "canary"):
            gw.on_update(current(registry, alias))
    except Exception as exc:  # noqa: BLE001 - kafka errors
        raise kafka_failure(config, exc, f"follow {config.kafka.model_updates_topic}") from None
    mode = gw.check_logprobs()
    if mode == "raw" and not allow_raw_logprobs:
        follower.close()
        interactions.close()
        feedback.close()
        raise click.ClickException(
            f"{upstream} returns raw log-probs (before temperature, top-k and top-p), not those of the "
            f"distribution it samples from: training would weigh its answers wrongly. Start vLLM with "
            f"{LOGPROBS_FLAG}, or pass --allow-raw-logprobs to keep such answers without their log-probs."
        )
    if mode == "unknown":
        click.echo(
            f"warning: could not tell whether {upstream} returns processed log-probs (probed again every "
            f"30 s); until then answers away from temperature 1 are kept without them",
            err=True,
        )
    follower.start()
    stop = threading.Event()
    gw.poll(poll_s, stop)
    click.echo(f"rtrl gateway on http://{host}:{port} -> {upstream} (champion {gw.champion or 'base'})", err=True)
    try:
        uvicorn.run(create_gateway_app(gw), host=host, port=port, log_level="warning")
    finally:
        stop.set()
        follower.close()
        interactions.close()
        feedback.close()


COMMANDS = [gateway]
