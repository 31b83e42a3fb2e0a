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
       it follows the registry through the model-update events
    3. asks the upstream for what training needs -- the sampled tokens' log-probs and ids
       (`logprobs`, vLLM's `return_tokens_as_token_ids`) -- and gives the client the answer in
       the shape it asked for (log-probs only if it asked, tokens as text unless it asked for ids)
    4. appends the interaction event to the write-ahead spool (pipeline/core/spool.py) before
       the client gets the answer's end -- a streamed answer's before its [DONE], marked
       truncated if the client left first -- so that a gateway killed at any moment has kept the
       event of every answer it gave. The append is a write to a file (the spool's fsyncs and
       its sends to Kafka happen in its own threads), so the event loop never waits on the
       broker; Kafka being away only makes the spool hold more.
An upstream error reaches the client as the upstream gave it (a 502 or 504 with the reason when
there was no answer at all), and no event is sent for a request that got no answer.

The vLLM fields relied on, as its OpenAI-compatible server defines them
(vllm/entrypoints/openai/protocol.py, read at commit 0052bed3; the README says how far this
was checked): `logprobs` (chat: true; completions: 0), `return_tokens_as_token_ids`, and in the
answer `logprobs.content[].token` as "token_id:<id>", `.logprob`, `.bytes` (chat) and
`logprobs.tokens` / `token_logprobs` (completions).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import aiohttp
import requests
from prometheus_client import CollectorRegistry, Counter

from deploy.rollout import routes_to_canary
from pipeline.core.types import InteractionEvent, ModelUpdate

log = logging.getLogger("rtrl.gateway")
# Request ids: 64 random bits drawn once per process, then a counter -- unique across replicas
# and restarts like a uuid4, without a getrandom call per request (a tenth of the gateway's
# time per request in benchmarks/gateway.py). Canary routing hashes the whole id.
_ID_PREFIX, _ids = uuid.uuid4().hex[:16], itertools.count()


def new_id(kind: str) -> str:
    return f"{kind}-{_ID_PREFIX}{next(_ids):010x}"
Emit = Callable[[dict[str, Any]], None]


class Gateway:
    """The routing state (champion, canary) and the events' way out."""

    def __init__(self, upstream: str, model_name: str, emit_interaction: Emit | None, emit_feedback: Emit | None,
                 default_tenant: str = "default", timeout_s: float = 120.0) -> None:
        self.upstream, self.model_name, self.timeout_s = upstream.rstrip("/"), model_name, timeout_s
        self.emit_feedback, self.default_tenant = emit_feedback, default_tenant
        self.http = requests.Session()  # /v1/models only: the completions go through session()
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self.champion: str | None = None
        self.canary: str | None = None
        self.canary_share = 0.0
        # request and episode ids answered ("r:" / "e:" + id): feedback for others is counted
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.metrics = CollectorRegistry()
        self.requests = Counter("rtrl_gateway_requests", "Requests by endpoint and outcome", ["endpoint", "outcome"],
                                registry=self.metrics)
        self.events = Counter("rtrl_gateway_events", "Events by type and outcome (sent, or lost: neither Kafka "
                              "nor the spool took it)", ["type", "outcome"], registry=self.metrics)
        self.unknown = Counter("rtrl_gateway_feedback_unknown_request", "Feedback for a request or episode id this "
                               "gateway did not answer (accepted: the join handles any order)", registry=self.metrics)
        self.emit_interaction = emit_interaction

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
            session = self._sessions[loop] = aiohttp.ClientSession(
                timeout=timeout, connector=aiohttp.TCPConnector(limit=0))
        return session

    def on_update(self, ev: ModelUpdate) -> None:
        """A model-update event, read back from the registry (deploy/follow.py)."""
        if ev.alias == "canary":
            self.canary, self.canary_share = ev.version, ev.share if ev.version else 0.0
        else:
            self.champion = ev.version
        log.info("routing updated", extra={"champion": self.champion, "canary": self.canary,
                                            "share": self.canary_share})

    def route(self, key: str) -> tuple[str, str | None]:
        """(the version that answers, its model name on the upstream; None: the base, as asked);
        `key`: the request's episode id when it names one (an episode's calls go to one version),
        else its request id."""
        version = self.champion
        if self.canary is not None and routes_to_canary(key, self.canary_share):
            version = self.canary
        return (version, f"{self.model_name}-v{version}") if version else ("base", None)

    def answered(self, request_id: str, episode_id: str | None) -> None:
        self.recent[f"r:{request_id}"] = None
        if episode_id is not None:
            self.recent[f"e:{episode_id}"] = None
        while len(self.recent) > 100_000:
            self.recent.popitem(last=False)

    def keep(self, build: Callable[[], InteractionEvent]) -> None:
        """Build the event and hand it to the events' way out (the write-ahead spool: an append,
        never a wait on the broker or an fsync) before the answer is given."""
        try:
            event = build().to_wire()
        except Exception as exc:  # noqa: BLE001 - what the upstream answered breaks the contract
            self.events.labels("interaction", "invalid").inc()
            log.error("interaction event not built", extra={"error": f"{type(exc).__name__}: {exc}"})
            return
        self._emit("interaction", self.emit_interaction, event)

    def _emit(self, kind: str, emit: Emit | None, event: dict[str, Any]) -> None:
        if emit is None:
            return
        try:
            emit(event)
            self.events.labels(kind, "sent").inc()
        except Exception as exc:  # noqa: BLE001 - a full spool: counted and logged, the gateway goes on
            self.events.labels(kind, "lost").inc()
            log.error("event not delivered", extra={"type": kind, "request_id": event.get("request_id"),
                                                    "error": f"{type(exc).__name__}: {exc}"})
