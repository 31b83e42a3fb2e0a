"""Shared, dependency-free types: the event contract v1 and the dead-letter reasons.

Every Kafka record carries exactly one JSON event. Two types exist in v1:

    interaction  what the serving policy produced for a request (prompt, completion, ...)
    feedback     what a user or the environment did about it afterwards (accepted, edited, ...)

Both share the envelope `schema_version, event_id, type, ts`. An interaction names its
`request_id` (and, for one call of an agent's multi-call task, its `episode_id` and `step`); a
feedback event names the `request_id` of the call it concerns or the `episode_id` of the
whole episode whose outcome it reports -- exactly one of them. Unknown fields are
kept: the store keeps every event's JSON text verbatim, so the models only validate what the
contract names (`extra="ignore"`; copying extras into each model would double validation
time). A producer may add fields without a coordinated release; a *newer* `schema_version`
than this code supports is refused (dead letter), never guessed at.

This module imports only pydantic and the standard library: every stage may depend on it.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    model_validator,
)

SCHEMA_VERSION = 1
"""The newest event schema version this code understands."""

FEEDBACK_KINDS_KNOWN = (
    "accepted",
    "rejected",
    "edited",
    "persisted",
    "followup",
    "thumbs",
    "tool_error",
    "test_result",
)
"""Feedback kinds with a documented meaning. The set is open: any other kind is stored as-is."""


class DeadLetterReason(str, enum.Enum):
    """Why a record could not become an event. Stored as the short string value."""

    INVALID_UTF8 = "invalid_utf8"
    MALFORMED_JSON = "malformed_json"
    SCHEMA_VIOLATION = "schema_violation"
    UNSUPPORTED_SCHEMA_VERSION = "unsupported_schema_version"
    OVERSIZED = "oversized"
    STORE_REFUSED = "store_refused"  # valid, but the store would not hold it (see store.events.write_rows)


def _identifier(value: str) -> str:
    # Identifiers end up in indexed text columns: PostgreSQL text cannot hold NUL.
    if "\x00" in value:
        raise ValueError("must not contain NUL characters")
    if not value.strip():
        raise ValueError("must not be blank")
    return value


def _utc(value: datetime) -> datetime:
    # RFC 3339 requires an offset; a naive timestamp is ambiguous, so it is refused.
    if value.tzinfo is None:
        raise ValueError("must carry a UTC offset (RFC 3339), e.g. 2026-01-01T12:00:00Z")
    return value.astimezone(UTC)


Identifier = Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_identifier)]
EventTime = Annotated[datetime, AfterValidator(_utc)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]

ChatMessage = dict[str, Any]
"""A chat message as OpenAI-style dicts: {"role": "user"|"assistant"|"tool"|..., "content": ...}."""


class _Envelope(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: StrictInt = Field(ge=1, le=SCHEMA_VERSION)
    event_id: Identifier
    ts: EventTime

    def to_wire(self) -> dict[str, Any]:
        """The event as a producer sends it (JSON types; absent fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class Sampling(BaseModel):
    """How the completion was sampled, as far as later stages rely on it: the behaviour
    log-probs were taken from this distribution. Numbers must be numbers; other keys are kept
    (in the body) but not read."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    temperature: FiniteFloat | None = Field(default=None, ge=0)
    top_p: FiniteFloat | None = Field(default=None, gt=0, le=1)
    top_k: StrictInt | None = None  # -1 or 0: off (vLLM's and transformers' conventions)
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = None


@dataclass(frozen=True)
class SamplingParams:
    """The distribution an episode's tokens were drawn from, as training and the gate recompute
    it (train/sampling.py): temperature, then top-k (0: off), then top-p (1.0: off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


def sampling_params(sampling: Any) -> SamplingParams:
    """From an event's `sampling` (a dict as stored). Not recorded: temperature 1, no cut-off.
    Temperature 0 (greedy) is read as plain temperature 1: a greedy server reports log-probs of
    the untouched distribution. top_k <= 0 (vLLM's -1) is off. ValueError when a value is not
    usable (events stored before the contract checked it): the episode is skipped and counted."""
    if sampling is None:
        return SamplingParams()
    if not isinstance(sampling, dict):
        raise ValueError(f"sampling is {type(sampling).__name__}, not an object")
    value = sampling.get("temperature")
    if value is None or value == 0:
        return SamplingParams()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"sampling.temperature {value!r} is not a positive number")
    top_p, top_k = sampling.get("top_p"), sampling.get("top_k")
    if top_p is None:
        top_p = 1.0
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"sampling.top_p {top_p!r} is not a number in (0, 1]")
    if top_k is None:
        top_k = 0
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ValueError(f"sampling.top_k {top_k!r} is not an integer")
    return SamplingParams(float(value), float(top_p), max(int(top_k), 0))


class InteractionEvent(_Envelope):
    """What the serving policy produced. `completion` is text, or for a multi-step agent
    trajectory a list of assistant and tool messages (only assistant tokens are trained)."""

    type: Literal["interaction"]
    request_id: Identifier
    session_id: Identifier
    user_id: Identifier
    tenant: Identifier
    policy_version: Identifier
    prompt: str | list[ChatMessage]
    completion: str | list[ChatMessage]
    completion_token_ids: list[StrictInt] | None = None
    behavior_logprobs: list[FiniteFloat] | None = None
    sampling: Sampling | None = None
    latency_ms: FiniteFloat | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None
    client_request_id: str | None = Field(default=None, max_length=256)  # the client's X-Request-Id (rtrl serve)
    # the tools offered (OpenAI function schemas): part of what the chat template rendered
    tools: list[dict[str, Any]] | None = None
    # the tool calls the completion's text holds, as the server parsed them (OpenAI shape); one
    # that did not parse, named no offered tool or broke its schema carries an `error`
    tool_calls: list[dict[str, Any]] | None = None
    group_id: Identifier | None = None  # the siblings of one request with n > 1 (one group for advantages)
    # the agent episode (task) this call belongs to, as its application names it: its calls share
    # the episode's outcome (reward spec [episode]); None -- an episode of this one call
    episode_id: Identifier | None = None
    step: StrictInt | None = Field(default=None, ge=0, le=1_000_000)  # the call's place in its episode (0 first)
    truncated: bool | None = None  # the client went away mid-stream: not trained on


def _feedback_value(value: Any) -> Any:
    # beyond 1e15 a value is no outcome but a producer's bug, and SQLite's JSON functions print
    # 15 significant digits: near the float limit the reward stage would read back infinity
    if not isinstance(value, bool) and abs(value) > 1e15:
        raise ValueError("must be at most 1e15 in magnitude")
    return value


class FeedbackEvent(_Envelope):
    """What happened after serving. `kind` is an open set (see FEEDBACK_KINDS_KNOWN). It names
    the call it concerns (`request_id`) or the agent episode whose outcome it reports
    (`episode_id`: every call of the episode is credited with it, see reward.compute)."""

    type: Literal["feedback"]
    request_id: Identifier | None = None
    episode_id: Identifier | None = None
    kind: Identifier
    value: Annotated[StrictBool | StrictInt | FiniteFloat, AfterValidator(_feedback_value)]
    payload: dict[str, Any] | str | None = None
    # the tenant whose episode `episode_id` names (the interactions' `tenant`): two tenants' "task-7"
    # are two episodes. None: not named -- the outcome of that episode id in every tenant, as
    # before tenants were named (a multi-tenant application names them). A request id needs
    # none: servers choose it, unguessable
    tenant: Identifier | None = None

    @model_validator(mode="after")
    def _one_subject(self) -> FeedbackEvent:
        # both would be ambiguous: an outcome of the call, or of its whole episode?
        if (self.request_id is None) == (self.episode_id is None):
            raise ValueError(
                "name exactly one of request_id (an outcome of one call) and episode_id "
                "(an outcome of the whole episode)"
            )
        return self


Event = Annotated[InteractionEvent | FeedbackEvent, Field(discriminator="type")]


def first_violation(exc: ValidationError) -> tuple[str, str]:
    """(the field, the reason) of an event's first contract violation, as producers are told it."""
    first = exc.errors()[0]
    return ".".join(str(p) for p in first["loc"]) or "event", first["msg"]


def completion_parts(completion: Any) -> tuple[str, tuple]:
    """(assistant text, tool calls) of a completion: text, or a trajectory of messages where
    only assistant turns are the policy's output (their texts joined by newlines, their tool
    calls as sent). Ingest stores both beside the body; the reward stage reads them there."""
    if isinstance(completion, str):
        return completion, ()
    texts: list[str] = []
    calls: list[Any] = []
    for msg in completion if isinstance(completion, list) else ():
        if isinstance(msg, dict) and msg.get("role") == "assistant":
            content = msg.get("content")
            if isinstance(content, str):
                texts.append(content)
            calls.extend(msg.get("tool_calls") or ())
    return "\n".join(texts), tuple(calls)


def prompt_key(prompt: Any) -> bytes:
    """A prompt (text or messages) as canonical bytes: equal prompts, equal keys. Training groups
    episodes by it; the held-out slice hashes it."""
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "replace")


def task_key(prompt: Any) -> bytes:
    """The task a prompt asks for, as canonical bytes: its first user message (an agent's later
    calls carry the same task with more turns after it; a system prompt is not the task), the
    whole prompt when it has none (text prompts). Training's group-relative advantages compare
    the episodes of one task."""
    if isinstance(prompt, list):
        for message in prompt:
            if isinstance(message, dict) and message.get("role") == "user":
                return prompt_key(message.get("content"))
    return prompt_key(prompt)


def is_our_version(policy_version: str) -> bool:
    """Whether a call was served by the policy this loop trains: "base" (before any promotion) or
    a version of its registered model (the registry numbers them). A call another model served
    -- a frozen sub-agent under a trained orchestrator, a vendor's model in the same episode --
    is context: rewarded and credited like any call, never trained on or evaluated as ours."""
    return policy_version == "base" or policy_version.isdigit()


def expects_attempt(metadata: Any) -> bool:
    """`metadata.expects_attempt` of an interaction, true unless the producer says otherwise:
    whether an abstention (empty output, a clarifying question) is a failure to attempt."""
    return bool(metadata.get("expects_attempt", True)) if isinstance(metadata, dict) else True


class DeadLetter(BaseModel):
    """A record that did not become an event: the raw bytes, why, and where it came from."""

    model_config = ConfigDict(frozen=True)

    reason: DeadLetterReason
    detail: str
    raw: bytes
    source: str  # Kafka topic, or "file:<path>" for replays from files
    partition: int  # -1 for files
    offset: int  # Kafka offset, or line number for files


@dataclass
class LoggedEpisode:
    """A served episode as logged, for scoring a policy on it (evaluation, the server's tests):
    the prompt, what was served (text, and the token ids when serving sent them), the behaviour
    log-probs and sampling temperature it was drawn with, and its reward."""

    request_id: str
    prompt: Any
    completion: Any
    completion_token_ids: list[int] | None = None
    behavior_logprobs: list[float] | None = None
    temperature: float = 1.0
    reward: float = 0.0
    top_p: float = 1.0  # with temperature: the distribution the tokens were drawn from (SamplingParams)
    top_k: int = 0
    tools: list[dict] | None = None  # the tools the prompt offered (rendered with it)


@dataclass(frozen=True, slots=True)
class SourcePosition:
    """Where a record was read from, so rows can be traced back to the log. A dataclass, not a
    model: ingest makes one per record, from values the Kafka client typed."""

    source: str
    partition: int
    offset: int


@dataclass(frozen=True)
class ModelUpdate:
    """An alias move, as the registry announces it on the model-updates topic and as followers
    (rtrl serve, the vLLM sync) act on it. `version` None: the alias was cleared (serve the base
    model; for a canary, withdraw it). `share`: a canary's share of requests. A follower trusts
    only `name` and `alias` from the wire and reads the rest from the registry (deploy/serving/follow.py),
    so a forged or stale event can make it look, never make it serve something else."""

    alias: str
    version: str | None
    adapter_uri: str | None = None
    share: float = 0.0
    name: str | None = None  # the registered model
    seq: int | None = None  # the alias move's id in the audit trail (None: read from the registry)
    base_model: str | None = None
    run_id: str | None = None
    at: str | None = None  # when the move was announced (ISO 8601, UTC)

    def to_dict(self) -> dict[str, Any]:
        return {
            "type": "model_update",
            "name": self.name,
            "alias": self.alias,
            "version": self.version,
            "adapter_uri": self.adapter_uri,
            "share": self.share,
            "seq": self.seq,
            "base_model": self.base_model,
            "run_id": self.run_id,
            "at": self.at,
        }

    @classmethod
    def from_json(cls, raw: bytes | str) -> ModelUpdate:
        """ValueError when `raw` is no model-update event (what a follower skips and logs)."""
        event = json.loads(raw)
        if not isinstance(event, dict) or event.get("type", "model_update") != "model_update":
            raise ValueError("not a model_update event")
        alias, version, share = event.get("alias"), event.get("version"), event.get("share") or 0.0
        if (
            not isinstance(alias, str)
            or not (version is None or isinstance(version, str))
            or isinstance(share, bool)
            or not isinstance(share, (int, float))
        ):
            raise ValueError("a model_update event needs a string alias, a string or null version, a numeric share")
        text = {
            k: event.get(k) if isinstance(event.get(k), str) else None
            for k in ("adapter_uri", "name", "base_model", "run_id", "at")
        }
        seq = event.get("seq") if isinstance(event.get("seq"), int) and not isinstance(event.get("seq"), bool) else None
        return cls(alias, version, share=float(share), seq=seq, **text)
