"""`rtrl gateway`: an OpenAI-compatible proxy in front of the model server a product already runs
(vLLM, SGLang, `rtrl serve`), so that its traffic feeds the loop without an event producer of
its own.

    POST /v1/chat/completions, /v1/completions   forwarded, streamed or not, tools passed through
    GET  /v1/models                               forwarded
    POST /v1/feedback                             an outcome of a call (request_id) or of an agent episode
                                                  (episode_id): a feedback event (422 when it breaks the contract)
    POST /v1/interactions                         an interaction event of an application that serves itself
    GET  /health, /metrics

For each request the gateway:
    1. assigns the request id (X-Request-Id; a client's own is kept as `client_request_id`) and
       takes the episode id from X-Rtrl-Episode-Id (the call's step from X-Rtrl-Step)
    2. routes it: `model` becomes the champion's LoRA name on the upstream (`<model>-v<version>`,
       as `rtrl serve --vllm` loads them), or the canary's for the canary's share of request ids;
       it follows the registry through the model-update events, and moves to a version only once
       the upstream lists it in /v1/models (`reconcile`, every poll): vLLM loads an adapter after
       the registry moved, and a name it has not loaded answers 404
    3. asks the upstream for what training needs -- the sampled tokens' log-probs and ids
       (`logprobs`, vLLM's `return_token_ids`) -- with every sampling setting sent
       explicitly (deploy/serving/gateway_sampling.py: what sampled the tokens is what the event
       records), and gives the client the answer in the shape it asked for
    4. records each choice whole (deploy/serving/gateway_record.py: its own request id, tool-call
       fragments joined) and appends its interaction event to the write-ahead spool
       (pipeline/core/spool.py) before the client gets the answer's end -- a streamed answer's
       before its [DONE], marked truncated if the client left first or the upstream failed -- so
       that a gateway killed at any moment has kept the event of every answer it gave. The append
       is a write to a file (the spool's fsyncs and its sends to Kafka happen in its own threads),
       so the event loop never waits on the broker; Kafka being away only makes the spool hold more.
An upstream error before any answer reaches the client as the upstream gave it (a 502 or 504
with the reason when there was no answer at all), and no event is sent for it.

The upstream's protocol is vLLM v0.34.0's OpenAI-compatible server, as tests/support/vllm_stub.py
implements it from that release's source (and rtrl serve implements the same fields).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
import requests
from prometheus_client import CollectorRegistry, Counter, Gauge

from deploy.serving.gateway_sampling import PROBE_PROMPTS, PROBE_TEMPERATURES, LogprobsMode, classify_probe
from deploy.serving.routing import routes_to_canary, routing_salt
from pipeline.core.types import InteractionEvent, ModelUpdate

log = logging.getLogger("rtrl.gateway")
# Request ids: a keyed hash (blake2b, a 256-bit key drawn once per process) of a counter --
# unguessable, as feedback and canary routing need them (the next id cannot be predicted and
# claimed first through /v1/interactions), and unique across replicas and restarts, without a
# getrandom call per request (a tenth of the gateway's time per request in benchmarks/gateway.py).
_ID_KEY, _ids = os.urandom(32), itertools.count()


def new_id(kind: str) -> str:
    return f"{kind}-{hashlib.blake2b(next(_ids).to_bytes(8, 'big'), key=_ID_KEY, digest_size=16).hexdigest()}"


Emit = Callable[[dict[str, Any]], None]


class Gateway:
    """The routing state (champion, canary) and the events' way out."""

    def __init__(
        self,
        upstream: str,
        model_name: str,
        emit_interaction: Emit | None,
        emit_feedback: Emit | None,
        default_tenant: str = "default",
        timeout_s: float = 120.0,
        blocking: bool = False,
        ingest_token: str | None = None,
        routing_secret: str = "",
        max_body_bytes: int = 16 << 20,
        body_timeout_s: float = 30.0,
    ) -> None:
        """`blocking`: the events' spool blocks when full (spool.when_full = "block");
        `ingest_token`: what /v1/feedback and /v1/interactions require as `Authorization: Bearer`
        (None: those routes are off); `routing_secret`: salts the canary's hash (the same for every
        replica) and signs the routing choice for an rtrl serve behind (deploy/serving/routing.py);
        `max_body_bytes`, `body_timeout_s`: the largest request body, and how long it may take to
        arrive."""
        self.upstream, self.model_name, self.timeout_s = upstream.rstrip("/"), model_name, timeout_s
        self.emit_feedback, self.default_tenant, self.blocking = emit_feedback, default_tenant, blocking
        self.ingest_token = ingest_token
        self.max_body_bytes, self.body_timeout_s = max_body_bytes, body_timeout_s
        self.routing_secret = routing_secret or os.urandom(16).hex()  # one replica: its own
        self.base_model: str | None = None  # the upstream's base model (/v1/models: no parent)
        self.http = requests.Session()  # /v1/models only: the completions go through session()
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        # the routes taken (only to versions the upstream serves) and the registry's (wanted_*)
        self.champion: str | None = None
        self.canary: str | None = None
        self.canary_share = 0.0
        self.wanted_champion: str | None = None
        self.wanted_canary: tuple[str | None, float] = (None, 0.0)
        self._lock = threading.Lock()
        self._reconciling = threading.Lock()
        # request ids and (tenant, episode id)s answered: feedback for others is counted
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.metrics = CollectorRegistry()
        self.requests = Counter(
            "rtrl_gateway_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"], registry=self.metrics
        )
        self.events = Counter(
            "rtrl_gateway_events",
            "Events by type and outcome (sent, or lost: neither Kafka nor the spool took it)",
            ["type", "outcome"],
            registry=self.metrics,
        )
        self.unknown = Counter(
            "rtrl_gateway_feedback_unknown_request",
            "Feedback for a request or episode id this gateway did not answer (accepted: the join handles any order)",
            registry=self.metrics,
        )
        self.routing_settled = Gauge(
            "rtrl_gateway_routing_settled",
            "1 when routing is the registry's; 0 while the upstream does not serve a version the registry moved to",
            registry=self.metrics,
        )
        self.emit_interaction = emit_interaction
        # whether the upstream's log-probs are those of the distribution it sampled from
        # (deploy/serving/gateway_sampling.py): set by check_logprobs(), at start-up
        self.logprobs_mode: LogprobsMode = "unknown"
        self.logprobs_gauge = Gauge(
            "rtrl_gateway_upstream_logprobs_processed",
            "1: the upstream returns the sampled "
            "distribution's log-probs; 0: raw ones (kept only at temperature 1); -1: not "
            "known yet",
            registry=self.metrics,
        )
        self.logprobs_gauge.set(-1.0)

    def check_logprobs(self) -> LogprobsMode:
        """Probe the upstream: a one-token completion of a few prompts at three temperatures,
        on its base model (the first of /v1/models without a parent). "unknown" when it cannot
        tell (the upstream away, every probe certain): events then keep their log-probs only
        where raw and processed ones coincide."""
        samples: list[list[tuple[object, float]]] = []
        try:
            listed = self._models()
            base = _base_of(listed) or listed[0]["id"]
            for prompt in PROBE_PROMPTS:
                got = []
                for temperature in PROBE_TEMPERATURES:
                    body = {
                        "model": base,
                        "prompt": prompt,
                        "max_tokens": 1,
                        "temperature": temperature,
                        "seed": 0,
                        "logprobs": 0,
                        "return_tokens_as_token_ids": True,
                    }
                    answer = self.http.post(f"{self.upstream}/v1/completions", json=body, timeout=self.timeout_s)
                    answer.raise_for_status()
                    lp = answer.json()["choices"][0]["logprobs"]
                    got.append((lp["tokens"][0], float(lp["token_logprobs"][0])))
                samples.append(got)
        except Exception as exc:  # noqa: BLE001 - any failure leaves it unknown, said in the log
            log.warning(
                "the upstream's log-probs could not be probed",
                extra={"upstream": self.upstream, "error": f"{type(exc).__name__}: {exc}"},
            )
        self.logprobs_mode = classify_probe(samples)
        self.logprobs_gauge.set({"processed": 1.0, "raw": 0.0}.get(self.logprobs_mode, -1.0))
        return self.logprobs_mode

    async def session(self) -> aiohttp.ClientSession:
        """The event loop's pooled connections to the upstream (one loop under uvicorn; a test
        client may run one per request). Timeouts: connecting, and between two reads of the
        answer -- a stream may take as long as it keeps sending."""
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            for old in [other for other in self._sessions if other.is_closed()]:
                del self._sessions[old]  # (their connections went with their loop)
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s, sock_read=self.timeout_s)
            session = self._sessions[loop] = aiohttp.ClientSession(  # (a stream's line may be long: a
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0), read_bufsize=1 << 22
            )  # chunk of ids)
        return session

    def on_update(self, ev: ModelUpdate) -> None:
        """A model-update event, read back from the registry (deploy/serving/follow.py): what to route to
        once the upstream serves it."""
        with self._lock:
            if ev.alias == "canary":
                self.wanted_canary = (ev.version, ev.share if ev.version else 0.0)
            else:
                self.wanted_champion = ev.version
        self.reconcile()

    def _models(self) -> list[dict[str, Any]]:
        """The upstream's /v1/models cards (vLLM lists its base model and each loaded adapter)."""
        listed = self.http.get(f"{self.upstream}/v1/models", timeout=self.timeout_s).json()["data"]
        return [m for m in listed if isinstance(m, dict)]

    def adapter(self, version: str) -> str:
        return f"{self.model_name}-v{version}"

    def reconcile(self) -> bool:
        """Route to the registry's versions the upstream serves (listed by its /v1/models, as vLLM
        lists the LoRA adapters it has loaded); a version it does not serve yet keeps the previous
        route -- the champion before it, or no canary -- until a later call finds it. True when
        routing is what the registry says. Called on each registry move and every poll_s."""
        with self._reconciling:  # one at a time: an older listing never lands after a newer one
            return self._reconcile()

    def _reconcile(self) -> bool:
        try:
            listed = self._models()
            served = {m["id"] for m in listed}
            self.base_model = _base_of(listed) or self.base_model
        except Exception as exc:  # noqa: BLE001 - the upstream away or odd: routes stay, tried again
            log.warning(
                "the upstream's models not read; routing unchanged",
                extra={"upstream": self.upstream, "error": f"{type(exc).__name__}: {exc}"},
            )
            return False
        with self._lock:
            before = (self.champion, self.canary, self.canary_share)
            wanted = self.wanted_champion
            if wanted is None or self.adapter(wanted) in served:
                self.champion = wanted
            elif self.champion is not None and self.adapter(self.champion) not in served:
                self.champion = None  # the previous one is gone too (an upstream restarted): the base
            version, share = self.wanted_canary
            if version is not None and self.adapter(version) in served and version != self.champion:
                self.canary, self.canary_share = version, share
            else:
                self.canary, self.canary_share = None, 0.0
            settled = self.champion == wanted and self.canary == (version if version != wanted else None)
            after = (self.champion, self.canary, self.canary_share)
        if after != before:
            log.info(
                "routing updated", extra={"champion": self.champion, "canary": self.canary, "share": self.canary_share}
            )
        if not settled:
            log.info(
                "waiting for the upstream to serve the registry's version",
                extra={
                    "champion": wanted,
                    "canary": version,
                    "routed_champion": self.champion,
                    "routed_canary": self.canary,
                },
            )
        self.routing_settled.set(1.0 if settled else 0.0)
        return settled

    def poll(self, interval_s: float, stop: threading.Event) -> threading.Thread:
        """Reconcile every `interval_s` until `stop` (a thread of its own: the event loop never waits)."""

        def run() -> None:
            last_probe = time.monotonic()
            while not stop.wait(interval_s):
                self.reconcile()
                if self.logprobs_mode == "unknown" and time.monotonic() - last_probe >= 30.0:
                    last_probe = time.monotonic()  # the upstream was away at start-up: probe again
                    if self.check_logprobs() == "raw":
                        log.error(
                            "the upstream returns raw log-probs: answers away from temperature 1 are kept "
                            "without them; start vLLM with --logprobs-mode processed_logprobs",
                            extra={"upstream": self.upstream},
                        )

        thread = threading.Thread(target=run, name="gateway-routes", daemon=True)
        thread.start()
        return thread

    def route(self, key: str) -> tuple[str, str | None]:
        """(the version that answers, its model name on the upstream: None for the base);
        `key`: the request's episode id when it names one (an episode's calls go to one version),
        else its request id."""
        version, model, _ = self.route_side(key)
        return version, model

    def route_side(self, key: str) -> tuple[str, str | None, str]:
        """route(), and the side chosen ("canary" or "champion"), from one reading of the routes."""
        with self._lock:  # (held by reconcile only to set the three together)
            champion, canary, share = self.champion, self.canary, self.canary_share
        if canary is not None and routes_to_canary(key, share, routing_salt(self.routing_secret, canary)):
            return canary, self.adapter(canary), "canary"
        return (champion, self.adapter(champion), "champion") if champion else ("base", None, "champion")

    def may_ingest(self, authorization: str | None) -> bool:
        """The ingestion routes' credential (compared in constant time)."""
        expected = f"Bearer {self.ingest_token}" if self.ingest_token else None
        return expected is not None and hmac.compare_digest((authorization or "").encode(), expected.encode())

    @staticmethod
    def subject(request_id: str | None, episode_id: str | None, tenant: str) -> str:
        """The key `recent` knows a call (request_id) or a tenant's episode by."""
        return f"r:{request_id}" if request_id is not None else f"e:{tenant}\x1f{episode_id}"

    def answered(self, request_id: str, episode_id: str | None, tenant: str) -> None:
        self.recent[self.subject(request_id, None, tenant)] = None
        if episode_id is not None:
            self.recent[self.subject(None, episode_id, tenant)] = None
        while len(self.recent) > 100_000:
            self.recent.popitem(last=False)

    async def keep(self, build: Callable[[], InteractionEvent]) -> None:
        """Build the event and hand it to the events' way out (the write-ahead spool: an append,
        never a wait on the broker or an fsync) before the answer is given."""
        try:
            event = build().to_wire()
        except Exception as exc:  # noqa: BLE001 - what the upstream answered breaks the contract
            self.events.labels("interaction", "invalid").inc()
            log.error("interaction event not built", extra={"error": f"{type(exc).__name__}: {exc}"})
            return
        await self.emit("interaction", self.emit_interaction, event)

    async def emit(self, kind: str, emit: Emit | None, event: dict[str, Any]) -> bool:
        """Whether the event was kept (False: a full spool refused it -- counted and logged). A
        spool that blocks when full waits in a thread of its own: the event loop, /health
        included, never waits for the broker to come back."""
        if emit is None:
            return True
        try:
            if self.blocking:
                await asyncio.to_thread(emit, event)
            else:
                emit(event)
        except Exception as exc:  # noqa: BLE001 - a full spool: counted and logged, the gateway goes on
            self.events.labels(kind, "lost").inc()
            log.error(
                "event not delivered",
                extra={"type": kind, "request_id": event.get("request_id"), "error": f"{type(exc).__name__}: {exc}"},
            )
            return False
        self.events.labels(kind, "sent").inc()
        return True


def _base_of(listed: list[dict[str, Any]]) -> str | None:
    """The base model of an upstream's /v1/models cards: the first without a parent."""
    return next((m["id"] for m in listed if not m.get("parent")), None)
