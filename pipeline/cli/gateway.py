"""`rtrl gateway`: the loop's capture in front of an OpenAI-compatible model server."""

from __future__ import annotations

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
    from deploy.serving.start import FollowFailed, GatewayJob, StartError, run_gateway

    job = GatewayJob(
        ctx.config,
        upstream,
        host=host,
        port=port,
        tenant=tenant,
        timeout_s=timeout_s,
        poll_s=poll_s,
        allow_raw_logprobs=allow_raw_logprobs,
        max_body_bytes=max_body_bytes,
        body_timeout_s=body_timeout_s,
    )
    try:
        run_gateway(job)
    except StartError as exc:
        raise click.ClickException(str(exc)) from None
    except FollowFailed as exc:
        raise kafka_failure(ctx.config, exc.cause, exc.doing) from None


COMMANDS = [gateway]
