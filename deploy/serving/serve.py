"""`rtrl serve`: a reference policy server for small models and the demo -- the policy side:
the model, the version it serves, the canary, and the interaction events. Its HTTP surface (an
OpenAI-compatible subset: tools, streaming, n) is deploy/serving/serve_api.py.

Every answer carries the per-token log-probs of what was sampled (after temperature and top-p)
and the version that produced it; every request becomes an `interaction` event on Kafka with the
same version as `policy_version`, so the loop can learn from it. Headers X-Session-Id and
X-Tenant fill the event.

Request ids: the server chooses every request's id (`req-<uuid>`: the response's `id` and its
X-Request-Id header; feedback names it). A client's own X-Request-Id is kept in the event as
`client_request_id`, never used as the id: a client could otherwise pick which side of a
canary answers it, or collide with another request's feedback.

Swapping: a model-update event loads the new adapter and switches to it under the model lock.
Generation holds the same lock, so a request in flight finishes on the version it started
with and the next one starts on the new version: nothing is dropped or failed by a swap.

Staged rollout: while the registry has a `canary`, the share of requests whose id hashes
below its share (deploy/serving/routing.py) are answered by the canary, the rest by the champion; each
interaction event names the version that answered, so the loop compares the two online. A
request whose `model` names the champion or the canary as vLLM names adapters
(`<model>-v<version>`) is answered by that version, and one marked `X-Rtrl-Routed: champion`
by the champion (the base has no adapter name) -- when `rtrl gateway` in front signed that
choice with the routing secret both share (RTRL_ROUTING_SECRET): a client's own `model` or
header chooses nothing. The canary's hash is salted with that secret.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deploy.serving.routing import routes_to_canary, routing_salt, routing_signature
from pipeline.core.chat import ToolCalls, parse_tool_calls
from pipeline.core.types import SCHEMA_VERSION, InteractionEvent, Sampling

log = logging.getLogger("rtrl.serve")
BASE = "base"  # the version name of the base model with no adapter


@dataclass
class Answer:
    """One choice of a request: what was generated, by which version, under which request id;
    the tool calls in it (None when no tools were offered); its siblings' group (n > 1)."""

    gen: Any  # train.inference.Generation
    version: str
    request_id: str
    calls: ToolCalls | None = None
    group_id: str | None = None
    seed: int | None = None  # what it was sampled with (choice i of a seeded request: seed + i)

    @property
    def finish(self) -> str:
        return "stop" if self.gen.stopped else "length"


class PolicyServer:
    """The model, the version it serves, and the lock that serialises generation and swaps."""

    def __init__(
        self,
        runner: Any,
        model_name: str,
        emit: Callable[[dict[str, Any]], None] | None = None,
        default_tenant: str = "default",
        keep_versions: int = 3,
        routing_secret: str = "",
    ) -> None:
        """`routing_secret`: RTRL_ROUTING_SECRET, shared with the gateway in front and the other
        replicas (deploy/serving/routing.py); without one, a secret of this process's own."""
        self.runner, self.model_name, self.emit = runner, model_name, emit
        self.default_tenant, self.keep_versions = default_tenant, keep_versions
        self.routing_secret = routing_secret or os.urandom(16).hex()
        self.version = BASE
        self.canary: str | None = None  # a staged candidate serving `canary_share` of requests
        self.canary_share = 0.0
        self.loaded: list[str] = []  # adapter versions in memory, oldest first
        self.lock = threading.Lock()
        self.metrics = CollectorRegistry()
        self.requests = Counter(
            "rtrl_serve_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=self.metrics
        )
        self.latency = Histogram("rtrl_serve_latency_seconds", "Generation latency", registry=self.metrics)
        self.swaps = Counter("rtrl_serve_swaps", "Adapter swaps applied", registry=self.metrics)
        self.undelivered = Counter(
            "rtrl_serve_events_undelivered",
            "Interaction events neither Kafka nor the spool took (lost)",
            registry=self.metrics,
        )
        self.spooled = Gauge(
            "rtrl_serve_events_spooled_bytes",
            "Interaction events waiting in the spool for Kafka",
            registry=self.metrics,
        )
        self.set_aside = Gauge(
            "rtrl_serve_events_set_aside",
            "Interaction events the broker refused for good (too "
            "large for the topic), kept in the spool's set-aside.jsonl",
            registry=self.metrics,
        )
        self.serving = Gauge("rtrl_serve_version", "Registry version being served (0 = base)", registry=self.metrics)
        self.canary_version = Gauge(
            "rtrl_serve_canary_version", "Registry version of the canary (0 = none)", registry=self.metrics
        )
        self.canary_share_gauge = Gauge(
            "rtrl_serve_canary_share", "Share of requests routed to the canary", registry=self.metrics
        )

    def use(self, version: str, adapter_dir: Path | None) -> None:
        """Serve `version` (its adapter loaded from `adapter_dir`) from the next request on. A
        canary of the same version is done: it is the champion now."""
        with self.lock:
            if version == self.version:
                return
            self._load(version, adapter_dir)
            self.version = version
            if self.canary == version:
                self._set_canary(None, 0.0)
            self._evict()
            self.swaps.inc()
            self.serving.set(float(version) if version.isdigit() else 0.0)
        log.info("serving a new version", extra={"version": version})

    def stage(self, version: str | None, adapter_dir: Path | None, share: float) -> None:
        """Route `share` of requests to `version` from the next request on (None: no canary)."""
        with self.lock:
            if version is not None and version != self.version:
                self._load(version, adapter_dir)
                self._set_canary(version, share)
            else:
                self._set_canary(None, 0.0)
            self._evict()
        log.info("canary " + ("staged" if self.canary else "cleared"), extra={"version": version, "share": share})

    def _set_canary(self, version: str | None, share: float) -> None:
        self.canary, self.canary_share = version, share
        self.canary_version.set(float(version) if version and version.isdigit() else 0.0)
        self.canary_share_gauge.set(share)

    def _load(self, version: str, adapter_dir: Path | None) -> None:
        if adapter_dir is not None and version not in self.loaded:
            self.runner.add(version, adapter_dir)
            self.loaded.append(version)

    def _evict(self) -> None:
        # keep up to keep_versions adapters in memory: the champion, the canary and the newest
        # others (a rollback is then instant); drop the oldest others
        spare = [v for v in self.loaded if v not in (self.version, self.canary)]
        while len(self.loaded) > self.keep_versions and spare:
            victim = spare.pop(0)
            self.loaded.remove(victim)
            self.runner.remove(victim)

    def answer(
        self,
        prompt: Any,
        req: Any,
        headers: dict[str, str],
        tools: list[dict] | None = None,
        parse_tools: list[dict] | None = None,
        on_token: Callable[[int, float], None] | None = None,
        stop: threading.Event | None = None,
        send_event: bool = True,
        request_id: str | None = None,
        version: str | None = None,
    ) -> list[Answer]:
        """`req.n` answers to `prompt` (sampling fields of `req`), each with its own request id;
        their tool calls parsed against `parse_tools`; their events sent unless the caller sends
        them itself (a stream, once it ends; it chose `request_id` with new_request_id() to name
        its chunks), answered by `version` if the caller chose it (choose()). Streaming: see
        PolicySet.generate."""
        # never the client's: they route the canary and join feedback
        ids = [request_id or new_request_id()] + [new_request_id() for _ in range(req.n - 1)]
        group = f"grp-{uuid.uuid4().hex}" if req.n > 1 else None
        with self.lock, self.latency.time():
            if version is None:
                # a request's choices all come from one version, an episode's calls too
                version = self.choose(
                    getattr(req, "model", None), headers, header_id(headers, "x-rtrl-episode-id") or ids[0]
                )
            gens = [
                self.runner.generate(
                    None if version == BASE else version,
                    [prompt],
                    max_new_tokens=req.max_tokens,
                    temperature=req.temperature,
                    top_p=req.top_p,
                    seed=None if req.seed is None else req.seed + i,
                    tools=tools,
                    on_token=on_token,
                    stop=stop,
                )[0]
                for i in range(req.n)
            ]
        answers = []
        for i, (request_id, gen) in enumerate(zip(ids, gens)):
            calls = (
                parse_tool_calls(gen.text, parse_tools, lambda k, r=request_id: f"call-{r[4:16]}-{k}")
                if parse_tools
                else None
            )
            answers.append(Answer(gen, version, request_id, calls, group, None if req.seed is None else req.seed + i))
        if send_event:
            for a in answers:
                self.send_event(a, prompt, req, headers, tools)
        return answers

    def choose(self, model: str | None, headers: dict[str, str], key: str) -> str:
        """The version that answers: the one a gateway in front chose -- the version its `model`
        names, or the champion -- when the request carries the gateway's signature of that
        choice (the shared RTRL_ROUTING_SECRET), else the champion or, for the canary's share of
        `key`s (salted: a client cannot pick its side), the canary."""
        if self.routed_by_gateway(model, headers):
            named = self.named(model)
            if named is not None:
                return named
            if headers.get("x-rtrl-routed") == "champion":
                return self.version  # the base has no adapter name
        version, canary = self.version, self.canary
        if canary is not None and routes_to_canary(key, self.canary_share, routing_salt(self.routing_secret, canary)):
            version = canary
        return version

    def routed_by_gateway(self, model: str | None, headers: dict[str, str]) -> bool:
        signature = headers.get("x-rtrl-routed-signature")
        if not signature:
            return False
        expected = routing_signature(
            self.routing_secret, headers.get("x-request-id") or "", headers.get("x-rtrl-routed") or "", model
        )
        return hmac.compare_digest(signature.encode(), expected.encode())

    def named(self, model: str | None) -> str | None:
        """The version a request's `model` names as vLLM names LoRA adapters --
        `<model name>-v<version>`, what `rtrl gateway` routes with -- if it is the champion or
        the canary (a gateway in front then decides the canary's share); None: route here."""
        prefix = f"{self.model_name}-v"
        if model and model.startswith(prefix) and model[len(prefix) :] in (self.version, self.canary):
            return model[len(prefix) :]
        return None

    def send_event(
        self,
        a: Answer,
        prompt: Any,
        req: Any,
        headers: dict[str, str],
        tools: list[dict] | None = None,
        truncated: bool = False,
    ) -> None:
        """The answer's interaction event to Kafka; one Kafka refuses is counted and logged. None
        for a request a gateway in front routed: the gateway records it (twice recorded, one copy
        would never be rewarded)."""
        if self.emit is None or self.routed_by_gateway(getattr(req, "model", None), headers):
            return
        try:
            event = InteractionEvent(
                schema_version=SCHEMA_VERSION,
                event_id=f"srv-{uuid.uuid4().hex}",
                type="interaction",
                ts=datetime.now(UTC),
                request_id=a.request_id,
                session_id=header_id(headers, "x-session-id") or a.request_id,
                user_id=req.user or "anonymous",
                tenant=header_id(headers, "x-tenant") or self.default_tenant,
                policy_version=a.version,
                prompt=prompt,
                completion=a.gen.text,
                completion_token_ids=a.gen.token_ids,
                behavior_logprobs=a.gen.logprobs,
                sampling=Sampling(temperature=req.temperature, top_p=req.top_p, max_tokens=req.max_tokens, seed=a.seed),
                latency_ms=round(a.gen.latency_ms, 3),
                metadata={"server": "rtrl-serve", "model": self.model_name},
                client_request_id=header_id(headers, "x-request-id"),
                tools=tools,
                tool_calls=a.calls.calls if a.calls is not None and a.calls.calls else None,
                group_id=a.group_id,
                episode_id=header_id(headers, "x-rtrl-episode-id"),
                step=header_step(headers),
                truncated=truncated or None,
            )
            self.emit(event.to_wire())
        except Exception as exc:  # noqa: BLE001 - serving goes on; the loss is counted and logged
            self.undelivered.inc()
            log.error("interaction event not delivered", extra={"request_id": a.request_id, "error": str(exc)})


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex}"


def header_id(headers: dict[str, str], name: str) -> str | None:
    """A header as an event identifier: at most 256 characters, None when absent or blank."""
    value = (headers.get(name) or "")[:256]
    return value if value.strip() else None


def header_step(headers: dict[str, str]) -> int | None:
    """X-Rtrl-Step, a call's place in its episode: None when absent or not a small integer (the
    reward stage then orders the episode's calls by time)."""
    value = (headers.get("x-rtrl-step") or "").strip()
    return int(value) if value.isdigit() and len(value) <= 6 else None
