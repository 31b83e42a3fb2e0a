"""rtrl's client library for applications: report what users did (feedback on one call, the
outcome of a whole agent episode) and, for an application that serves its model itself, what it
served -- as contract events (pipeline.core.types), through a gateway or straight to Kafka.

    from pipeline.client import Rtrl

    rtrl = Rtrl(gateway_url="http://127.0.0.1:8080")      # or Rtrl(bootstrap="kafka:9092")
    rtrl.feedback(request_id, kind="accepted", value=True)  # the X-Request-Id the gateway returned
    rtrl.episode_outcome("task-7", kind="persisted", value=True)

Two transports, one behaviour:

    gateway   POST /v1/feedback and /v1/interactions to `rtrl gateway`, which validates, counts
              and produces to Kafka (spooling while the broker is away); an event the gateway
              refuses raises ValueError with its reason, a gateway away -- or one that cannot keep
              the event (503: its spool is full while Kafka is away) -- raises ConnectionError
    kafka     produced by this process (acks=all): while the broker is away events wait in a
              local spool (append-only files, group-committed with fsync, bounded by
              `spool_max_bytes`; when full: refused with SpoolFull, or `when_full="block"`
              waits) and are sent in order once it is back; a restart sends what the spool holds.
              A broker that refuses the credentials or the topic's rights raises PermissionError
              (waiting will not help: nothing is spooled for it); a process forked after
              Rtrl(...) was built raises SpoolBusy -- build it in each worker, after the fork

Every event is validated by the contract's own models before it leaves: a bad one raises
ValueError here, naming the field, never becomes a dead letter downstream. Importing this
module loads neither torch, transformers nor mlflow (tests/integration/test_client.py checks).
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import requests
from pydantic import ValidationError

from pipeline.core.kafka_config import KafkaAccess
from pipeline.core.types import SCHEMA_VERSION, FeedbackEvent, InteractionEvent, first_violation

__all__ = ["Rtrl"]


class Rtrl:
    def __init__(
        self,
        gateway_url: str | None = None,
        *,
        bootstrap: str | KafkaAccess | None = None,
        interactions_topic: str = "rtrl.interactions",
        feedback_topic: str = "rtrl.feedback",
        spool_dir: str | Path | None = None,
        spool_max_bytes: int = 1 << 30,
        when_full: Literal["refuse", "block"] = "refuse",
        timeout_s: float = 10.0,
        token: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Give exactly one of `gateway_url` and `bootstrap` (a "host:port" list, or a
        KafkaAccess with TLS/SASL settings). With Kafka, `spool_dir` (default
        `$RTRL_STATE_DIR/spool/client`, else `~/.rtrl/spool/client`) holds what the broker has
        not acknowledged; one process per spool directory (a second one is refused: give each
        worker its own). `token`: the gateway's RTRL_GATEWAY_TOKEN (default: that variable);
        `tenant`: whose episodes the outcomes report -- episode ids are scoped by tenant: a
        multi-tenant application names it (None: the episode id in every tenant)."""
        if (gateway_url is None) == (bootstrap is None):
            raise ValueError("give exactly one of gateway_url (an rtrl gateway) and bootstrap (Kafka brokers)")
        self.timeout_s, self.tenant = timeout_s, tenant
        self.gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self.http = requests.Session() if gateway_url else None
        token = token if token is not None else os.environ.get("RTRL_GATEWAY_TOKEN")
        if self.http is not None and token:
            self.http.headers["Authorization"] = f"Bearer {token}"
        self.senders: dict[str, Any] = {}
        if bootstrap is not None:
            from deploy.serving.events import FEEDBACK_KEY, EventSender  # kafka-python: only when producing
            from pipeline.core.spool import Spool

            root = (
                Path(spool_dir)
                if spool_dir is not None
                else Path(os.environ.get("RTRL_STATE_DIR") or Path.home() / ".rtrl") / "spool" / "client"
            )
            for kind, topic, key in (
                ("interaction", interactions_topic, "request_id"),
                ("feedback", feedback_topic, FEEDBACK_KEY),
            ):
                self.senders[kind] = EventSender(
                    KafkaAccess.of(bootstrap),
                    topic,
                    key=key,
                    timeout_s=timeout_s,
                    spool=Spool(root / kind, spool_max_bytes, when_full),
                )

    # --- what users did ------------------------------------------------------------------

    def feedback(
        self,
        request_id: str,
        kind: str,
        value: bool | int | float,
        payload: Any = None,
        ts: datetime | None = None,
        event_id: str | None = None,
    ) -> str:
        """An outcome of one call (the request id the server returned). Returns the event id."""
        return self._feedback({"request_id": request_id}, kind, value, payload, ts, event_id, None)

    def episode_outcome(
        self,
        episode_id: str,
        kind: str,
        value: bool | int | float,
        payload: Any = None,
        ts: datetime | None = None,
        event_id: str | None = None,
        tenant: str | None = None,
    ) -> str:
        """The outcome of a whole agent episode (the id its calls were served under: the
        X-Rtrl-Episode-Id header, or `interaction(episode_id=...)`), credited to every call as the
        reward spec's [episode] section says; `tenant`: whose episode (default: the client's).
        Returns the event id."""
        return self._feedback({"episode_id": episode_id}, kind, value, payload, ts, event_id, tenant or self.tenant)

    # --- what an application that serves itself served ------------------------------------

    def interaction(
        self,
        *,
        prompt: str | list[dict[str, Any]],
        completion: str | list[dict[str, Any]],
        policy_version: str,
        request_id: str | None = None,
        session_id: str | None = None,
        user_id: str = "anonymous",
        tenant: str | None = None,
        episode_id: str | None = None,
        step: int | None = None,
        completion_token_ids: list[int] | None = None,
        behavior_logprobs: list[float] | None = None,
        sampling: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        latency_ms: float | None = None,
        metadata: dict[str, Any] | None = None,
        ts: datetime | None = None,
        event_id: str | None = None,
    ) -> str:
        """What the application's model answered (token ids and their log-probs as sampled,
        with the sampling settings, make it trainable off-policy). Returns the request id --
        new unless given -- that feedback names."""
        request_id = request_id or f"app-{uuid.uuid4().hex}"
        event = _valid(
            InteractionEvent,
            {
                "schema_version": SCHEMA_VERSION,
                "event_id": event_id or f"app-i-{uuid.uuid4().hex}",
                "type": "interaction",
                "ts": ts or datetime.now(UTC),
                "request_id": request_id,
                "session_id": session_id or request_id,
                "user_id": user_id,
                "tenant": tenant or self.tenant or "default",
                "policy_version": policy_version,
                "prompt": prompt,
                "completion": completion,
                "episode_id": episode_id,
                "step": step,
                "completion_token_ids": completion_token_ids,
                "behavior_logprobs": behavior_logprobs,
                "sampling": sampling,
                "tools": tools,
                "tool_calls": tool_calls,
                "latency_ms": latency_ms,
                "metadata": metadata,
            },
        )
        self._send("interaction", event.to_wire())
        return request_id

    def close(self) -> None:
        """Stop the spools' threads (what they hold stays on disk for the next start)."""
        for sender in self.senders.values():
            sender.close()
        if self.http is not None:
            self.http.close()

    def __enter__(self) -> Rtrl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _feedback(
        self,
        subject: dict[str, str],
        kind: str,
        value: Any,
        payload: Any,
        ts: datetime | None,
        event_id: str | None,
        tenant: str | None,
    ) -> str:
        event = _valid(
            FeedbackEvent,
            {
                "schema_version": SCHEMA_VERSION,
                "event_id": event_id or f"app-f-{uuid.uuid4().hex}",
                "type": "feedback",
                "ts": ts or datetime.now(UTC),
                **subject,
                "kind": kind,
                "value": value,
                "payload": payload,
                "tenant": tenant,
            },
        )
        self._send("feedback", event.to_wire())
        return event.event_id

    def _send(self, kind: str, event: dict[str, Any]) -> None:
        if self.http is None:
            self.senders[kind](event)  # returns once Kafka or the spool has it (SpoolFull: full)
            return
        path = "/v1/feedback" if kind == "feedback" else "/v1/interactions"
        try:
            answer = self.http.post(self.gateway_url + path, json=event, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise ConnectionError(
                f"the rtrl gateway at {self.gateway_url} did not answer ({exc}); is `rtrl gateway` running there?"
            ) from None
        if answer.status_code == 202:
            return
        reason = _reason(answer)
        if answer.status_code == 422:
            raise ValueError(f"the gateway refused the {kind} event: {reason}")
        if answer.status_code in (401, 403):
            raise PermissionError(f"the rtrl gateway at {self.gateway_url} refused the {kind} event: {reason}")
        if answer.status_code == 503:
            raise ConnectionError(
                f"the rtrl gateway at {self.gateway_url} could not keep the {kind} event "
                f"({reason}); retry in {answer.headers.get('Retry-After', '30')} s"
            )
        raise ConnectionError(f"the rtrl gateway at {self.gateway_url} answered {answer.status_code}: {reason}")


def _reason(answer: requests.Response) -> str:
    """The error message of a gateway's answer -- or, from something in front of it (a load
    balancer's HTML page), the start of its body: never a JSON error raised as the app's."""
    try:
        return str(answer.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return answer.text[:200]


def _valid(model: type, fields: dict[str, Any]) -> Any:
    """The event as the contract's model, or ValueError naming the field and the reason."""
    try:
        return model.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        field, reason = first_violation(exc)
        raise ValueError(f"{field}: {reason}") from None
