"""Serving started from the config: what `rtrl serve` and `rtrl gateway` call. The command parses
its options into a job and calls one of these; each blocks until Ctrl-C.

    serve_policy(job)   the registry's champion (and a canary's share) on the local model
    keep_vllm(job)      no server: a vLLM server's adapters kept on the registry's versions
    run_gateway(job)    the capture in front of another server, routing to the registry's versions

Each starts in this order, so that no request is answered by a version the registry has left:
  1. the follower of the model-updates topic built: it seeks to the topic's end now, so a move
     made while 2-4 run is still seen (a broker that cannot be reached: FollowFailed);
  2. the registry's champion and canary read, as every later update is read (follow.current);
     serve_policy then loads the base model, through ServeJob.load_policy (the caller's loader:
     serving imports no model code), the one named or else the champion's;
  3. the events' sender and its spool (write-ahead: an answer's event is on disk before its end is
     given, sent by the spool's thread; one spool per port, replicas on a machine share none) --
     run_gateway builds its two before 1, with the Gateway they feed: neither reads the registry;
  4. the server set to what 2 read, then the follower started: a move after 1 is applied by it;
  5. uvicorn until Ctrl-C; then the follower and the senders closed (what waits in a spool is on
     disk, sent by the next start).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from deploy.registry_read import RegistryError, RegistryReader
from deploy.serving.events import FEEDBACK_KEY, EventSender
from deploy.serving.follow import Follower, current
from pipeline.core.config import Config
from pipeline.core.logs import mask, quiet_progress_bars
from pipeline.core.spool import Spool
from pipeline.core.types import ModelUpdate

ALIASES = ("champion", "canary")


class StartError(RuntimeError):
    """Serving cannot start; the message says what to do next."""


class FollowFailed(RuntimeError):
    """The model-updates topic cannot be followed (the broker away, or refusing this client)."""

    def __init__(self, doing: str, cause: BaseException) -> None:
        super().__init__(f"cannot {doing}: {cause!r}")
        self.doing, self.cause = doing, cause


@dataclass(frozen=True)
class ServeJob:
    """One `rtrl serve`."""

    config: Config
    # base model directory -> the runner that answers (rtrl serve: train.inference.PolicySet.load);
    # it raises StartError, with what to do, for a directory it cannot load
    load_policy: Callable[[str], Any]
    host: str = "127.0.0.1"
    port: int = 8000
    base_model: str | None = None  # None: train.base_model, else the champion's base_model tag
    tenant: str = "default"  # of requests without X-Tenant
    events: bool = True  # send interaction events (off: answers are not recorded)


@dataclass(frozen=True)
class GatewayJob:
    """One `rtrl gateway` (each field is the command's option of the same name)."""

    config: Config
    upstream: str
    host: str = "127.0.0.1"
    port: int = 8080
    tenant: str = "default"
    timeout_s: float = 120.0
    poll_s: float = 2.0
    allow_raw_logprobs: bool = False
    max_body_bytes: int = 16 << 20
    body_timeout_s: float = 30.0


def _say(line: str) -> None:  # the commands' default: stderr, beside the logs
    print(line, file=sys.stderr, flush=True)


def _follower(config: Config, registry: RegistryReader, on_update: Callable[[ModelUpdate], None]) -> Follower:
    try:
        return Follower(
            config.kafka_access,
            config.kafka.model_updates_topic,
            config.mlflow.registered_model,
            on_update,
            lambda alias: current(registry, alias),
            aliases=ALIASES,
        )
    except Exception as exc:  # noqa: BLE001 - kafka errors, said by the command with the setting to check
        raise FollowFailed(f"follow {config.kafka.model_updates_topic}", exc) from exc


def _current(registry: RegistryReader) -> list[ModelUpdate]:
    """What serving starts from, read like every later update (a staged rollout in progress has its
    share tagged on the canary's version)."""
    try:
        return [u for u in (current(registry, a) for a in ALIASES) if u.version is not None]
    except (RegistryError, ValueError) as exc:
        raise StartError(str(exc)) from None


def _secret(name: str) -> str:
    value = os.environ.get(name, "")  # a credential: masked in every log line, never logged
    if value:
        mask(value)
    return value


def keep_vllm(job: ServeJob, vllm_url: str, say: Callable[[str], None] = _say) -> None:
    """Keep the vLLM server at `vllm_url` on the champion's adapter (and a canary's)."""
    from deploy.serving.vllm import VllmAdapterSync

    quiet_progress_bars()  # MLflow's download bars, each time an adapter is fetched for vLLM
    config, name = job.config, job.config.mlflow.registered_model
    registry = RegistryReader(config.tracking_uri, name, None)
    sync = VllmAdapterSync(vllm_url, name, registry.download, config.state_dir / "serve" / "adapters")
    follower = _follower(config, registry, sync.on_update)
    for update in _current(registry):
        sync.on_update(update)
    follower.start()
    say(f"keeping {vllm_url} on the champion of {name} (Ctrl-C stops)")
    try:
        follower.thread.join()
    except KeyboardInterrupt:
        follower.close()


def serve_policy(job: ServeJob, say: Callable[[str], None] = _say) -> None:
    """Serve the champion on the local model, following the registry (deploy/serving/serve.py)."""
    from deploy.serving.serve import BASE, PolicyServer
    from deploy.serving.serve_api import create_app

    quiet_progress_bars()
    config, name = job.config, job.config.mlflow.registered_model
    adapters = config.state_dir / "serve" / "adapters"
    registry = RegistryReader(config.tracking_uri, name, None)
    follower = _follower(config, registry, lambda update: None)
    now = _current(registry)
    try:
        champion = registry.alias("champion")
    except RegistryError as exc:
        raise StartError(str(exc)) from None
    base = job.base_model or config.train.base_model or (champion.tags.get("base_model") if champion else None)
    if base is None:
        raise StartError("no base model: pass --base-model or set train.base_model")
    runner = job.load_policy(base)
    spool = None if not job.events else Spool(_spool_dir(config, f"serve-{job.port}"), *_spool_limits(config))
    emit = (
        None
        if spool is None
        else EventSender(
            config.kafka_access,
            config.kafka.interactions_topic,
            key="request_id",
            timeout_s=10.0,
            spool=spool,
            write_ahead=True,
        )
    )
    secret = _secret("RTRL_ROUTING_SECRET")  # shared with the gateway in front
    if not secret and job.events:
        say(
            "warning: RTRL_ROUTING_SECRET is unset: behind an rtrl gateway, set the gateway's, or this "
            "server routes the canary's share itself and records every call a second time"
        )
    server = PolicyServer(runner, name, emit=emit, default_tenant=job.tenant, routing_secret=secret)
    if spool is not None:
        server.spooled.set_function(spool.size)
        server.set_aside.set_function(lambda: spool.set_aside)

    def on_update(update: ModelUpdate) -> None:
        adapter = registry.download(update.adapter_uri, adapters / f"v{update.version}") if update.version else None
        if update.alias == "canary":
            server.stage(update.version, adapter, update.share)
        else:  # a cleared champion alias: the base model serves, as before any promotion
            server.use(update.version or BASE, adapter)

    for update in now:
        on_update(update)
    follower.on_update = on_update
    follower.start()
    say(f"serving {name}:{server.version} on http://{job.host}:{job.port} (base {base})")
    try:
        uvicorn.run(create_app(server), host=job.host, port=job.port, log_level="warning")
    finally:
        follower.close()
        if emit is not None:
            emit.close()


def run_gateway(job: GatewayJob, say: Callable[[str], None] = _say) -> None:
    """The gateway in front of `job.upstream` (deploy/serving/gateway.py)."""
    from prometheus_client import Gauge

    from deploy.serving.gateway import Gateway
    from deploy.serving.gateway_api import create_gateway_app
    from deploy.serving.gateway_sampling import LOGPROBS_FLAG

    config = job.config

    def sender(topic: str, part: str, key: str | tuple[str, ...]) -> EventSender:
        # write-ahead: an event is in the spool (fsynced within its commit interval) before it is
        # sent, so a gateway killed under load loses at most that interval's events
        spool = Spool(_spool_dir(config, f"gateway-{job.port}") / part, *_spool_limits(config))
        return EventSender(config.kafka_access, topic, key=key, timeout_s=10.0, write_ahead=True, spool=spool)

    interactions = sender(config.kafka.interactions_topic, "interactions", "request_id")
    feedback = sender(config.kafka.feedback_topic, "feedback", FEEDBACK_KEY)
    token = _secret("RTRL_GATEWAY_TOKEN") or None  # the ingestion routes' credential
    secret = _secret("RTRL_ROUTING_SECRET")  # shared by every replica and rtrl serve behind
    if not secret:
        say(
            "warning: RTRL_ROUTING_SECRET is unset: this gateway salts the canary's hash with a secret of "
            "its own -- give every replica (and an rtrl serve behind it) the same one"
        )
    gw = Gateway(
        job.upstream,
        config.mlflow.registered_model,
        interactions,
        feedback,
        job.tenant,
        job.timeout_s,
        blocking=config.spool.when_full == "block",
        ingest_token=token,
        routing_secret=secret,
        max_body_bytes=job.max_body_bytes,
        body_timeout_s=job.body_timeout_s,
    )
    Gauge(
        "rtrl_gateway_events_set_aside",
        "Events the broker refused for good (too large for the topic), kept in the spool's set-aside.jsonl",
        registry=gw.metrics,
    ).set_function(lambda: interactions.spool.set_aside + feedback.spool.set_aside)
    registry = RegistryReader(config.tracking_uri, config.mlflow.registered_model, None)
    follower = _follower(config, registry, gw.on_update)
    try:
        for alias in ALIASES:
            gw.on_update(current(registry, alias))
    except (RegistryError, ValueError) as exc:
        raise StartError(str(exc)) from None
    mode = gw.check_logprobs()
    if mode == "raw" and not job.allow_raw_logprobs:
        follower.close()
        interactions.close()
        feedback.close()
        raise StartError(
            f"{job.upstream} returns raw log-probs (before temperature, top-k and top-p), not those of the "
            f"distribution it samples from: training would weigh its answers wrongly. Start vLLM with "
            f"{LOGPROBS_FLAG}, or pass --allow-raw-logprobs to keep such answers without their log-probs."
        )
    if mode == "unknown":
        say(
            f"warning: could not tell whether {job.upstream} returns processed log-probs (probed again every "
            f"30 s); until then answers away from temperature 1 are kept without them"
        )
    follower.start()
    stop = threading.Event()
    gw.poll(job.poll_s, stop)
    say(f"rtrl gateway on http://{job.host}:{job.port} -> {job.upstream} (champion {gw.champion or 'base'})")
    try:
        uvicorn.run(create_gateway_app(gw), host=job.host, port=job.port, log_level="warning")
    finally:
        stop.set()
        follower.close()
        interactions.close()
        feedback.close()


def _spool_dir(config: Config, name: str) -> Path:
    return config.state_dir / "spool" / name


def _spool_limits(config: Config) -> tuple[int, str]:
    return config.spool.max_bytes, config.spool.when_full
