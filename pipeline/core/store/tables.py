"""The store's tables: the single schema source. Alembic migrations are generated from here.

Raw facts (interactions, feedback, dead letters) are append-only and keyed by the producer's
`event_id`, so a record delivered twice is stored once. Consumer offsets live beside them and
are written in the same transaction as the rows they cover: that is what makes ingest
exactly-once. Everything else (rewards, runs, decisions) is derived and can be recomputed.

Timestamps are stored as naive UTC (`DateTime` without zone) so SQLite and PostgreSQL agree.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    and_,
    or_,
)
from sqlalchemy.sql.elements import ColumnElement
from sqlalchemy.sql.selectable import FromClause

# Deterministic constraint names, so autogenerate and both dialects agree.
metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "pk": "pk_%(table_name)s",
    }
)

ID = String(256)

# Raw facts keep the event exactly as received in `body` (UTF-8 JSON text, unknown fields
# included): export is byte-exact and ingest never re-serialises. The columns beside it are
# the fields stages filter and join on, normalised (ts in UTC).
interactions = Table(
    "interactions",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("event_id", ID, nullable=False, unique=True),
    Column("request_id", ID, nullable=False, index=True),
    Column("schema_version", Integer, nullable=False),
    Column("ts", DateTime, nullable=False, index=True),
    Column("session_id", ID, nullable=False),
    Column("user_id", ID, nullable=False),
    Column("tenant", ID, nullable=False),
    Column("policy_version", ID, nullable=False, index=True),
    Column("body", Text, nullable=False),
    # what the policy wrote, taken from the body at ingest (pipeline.core.types): a reward run reads
    # these instead of parsing every body (prompts are most of a body). Tool calls as a JSON array,
    # NULL when none. See alembic 0008.
    Column("output_text", Text, nullable=False),
    Column("output_tool_calls", Text),
    Column("expects_attempt", Boolean, nullable=False),
    # an agent's task: its calls share the episode's outcome (NULL: an episode of this one call);
    # `step` is the call's place in it as the producer numbered it (NULL: ordered by ts). See 0011.
    Column("episode_id", ID, index=True),
    Column("step", Integer),
    # where the row came from, for tracing; not part of the event
    Column("source", String(512), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("ingested_at", DateTime, nullable=False),
)

feedback = Table(
    "feedback",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("event_id", ID, nullable=False, unique=True),
    # the call the feedback concerns, or (exactly one of the two) the episode whose outcome it is;
    # looked up through ix_feedback_request_kind (request_id first): no index of its own (0012)
    Column("request_id", ID),
    Column("episode_id", ID, index=True),
    # whose episode (0014): an outcome joins the calls of its tenant's episode only (NULL: a
    # producer that names no tenant -- the episode id's calls in every tenant)
    Column("tenant", ID),
    Column("schema_version", Integer, nullable=False),
    Column("ts", DateTime, nullable=False, index=True),
    Column("kind", ID, nullable=False),  # no query filters by kind alone (0012)
    Column("value", Float, nullable=False),  # booleans as 1.0 / 0.0; the body keeps the original
    Column("body", Text, nullable=False),
    Column("source", String(512), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("ingested_at", DateTime, nullable=False),
)

dead_letters = Table(
    "dead_letters",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("source", String(512), nullable=False),
    Column("partition", Integer, nullable=False),
    Column("offset", BigInteger, nullable=False),
    Column("reason", String(64), nullable=False, index=True),
    Column("detail", Text, nullable=False),
    Column("raw", LargeBinary, nullable=False),
    Column("created_at", DateTime, nullable=False),
    # one dead letter per log position: re-delivery after a crash is absorbed like events
    UniqueConstraint("source", "partition", "offset"),
)

consumer_offsets = Table(
    "consumer_offsets",
    metadata,
    Column("group_id", String(256), primary_key=True),
    Column("topic", String(256), primary_key=True),
    Column("partition", Integer, primary_key=True),
    Column("next_offset", BigInteger, nullable=False),
    Column("updated_at", DateTime, nullable=False),
)

# --- derived data the later stages write ---------------------------------------------------

# One reward per episode (request_id) and spec version: rewards are derived data, recomputed
# from stored events when the spec changes. `last_feedback_id` is the newest feedback row the
# value reflects, so feedback that arrives later is found with one comparison.
rewards = Table(
    "rewards",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("request_id", ID, nullable=False),
    Column("spec_version", String(128), nullable=False),  # not indexed: see alembic 0007
    Column("policy_version", ID, nullable=False),  # not indexed: see alembic 0006
    Column("value", Float, nullable=False),
    Column("components", JSON, nullable=False),  # "signal.accepted": 0.5, "guard.abstention": -0.6
    # what the value reflects, counted: the call's feedback, and for a call of an agent episode
    # also the episode's outcome events and its calls (a late one changes everyone's credit)
    Column("feedback_count", Integer, nullable=False),
    Column("last_feedback_id", BigInteger, nullable=False),
    Column("computed_at", DateTime, nullable=False),
    # a call of an agent episode: {"episode_id", "events": the outcome's feedback event ids, "credit":
    # the share of the outcome this call got}; NULL for a call that is its own episode
    Column("outcome", JSON),
    UniqueConstraint("request_id", "spec_version"),
)

# How far the reward runs of one rule-based spec have settled the history (reward/stage.py):
# every first interaction of a request with an id below `settled_below` has a ripe reward that
# counted all its inputs, or cannot have one (`unusable`), so a run reads only what came after
# it and the episodes that new feedback or a new call in their agent episode names. The counts
# describe the settled ids (a run reports them without reading them); `pending` lists the
# settled episodes a run found unripe again, read again by the next run.
reward_progress = Table(
    "reward_progress",
    metadata,
    Column("spec_version", String(128), primary_key=True),
    Column("settled_below", BigInteger, nullable=False),  # an interactions.id
    Column("feedback_seen", BigInteger, nullable=False),  # a feedback.id: every row up to it was read
    Column("episodes", BigInteger, nullable=False),
    Column("duplicates", BigInteger, nullable=False),
    Column("unusable", BigInteger, nullable=False),
    Column("pending", JSON, nullable=False),  # request ids
    Column("updated_at", DateTime, nullable=False),
)

# The feedback rows a spec's reward runs read whose interaction (or agent episode) had not arrived:
# the orphans-to-be, counted once past the spec's orphan TTL, dropped once what they name arrived.
# A run counts orphans from these, not from the whole history (reward/stage.py).
reward_waiting = Table(
    "reward_waiting",
    metadata,
    Column("spec_version", String(128), primary_key=True),
    Column("feedback_id", BigInteger, primary_key=True),
    Column("ts", DateTime, nullable=False),  # the feedback's
)

# Lineage: the exact episodes (and the reward values) a training run used. Written by the
# training stage; a reward that changes afterwards (late feedback) leaves these rows alone.
training_episodes = Table(
    "training_episodes",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("run_id", String(128), nullable=False),
    Column("request_id", ID, nullable=False, index=True),
    Column("spec_version", String(128), nullable=False),
    Column("reward", Float, nullable=False),
    Column("outcome", JSON),  # the episode outcome the reward credited (rewards.outcome as used)
    Column("used_at", DateTime, nullable=False),
    UniqueConstraint("run_id", "request_id"),
)

# One row per training run: what it started from, the data window it read, where its adapter
# is, and how it ended. `watermark_to` is the newest reward row the run saw (rewards.id grows
# as episodes ripen): a run continued from this one reads only rewards after it.
training_runs = Table(
    "training_runs",
    metadata,
    Column("run_id", String(64), primary_key=True),
    Column("tracking_run_id", String(64)),  # the MLflow run
    Column("status", String(16), nullable=False),  # running | finished | failed
    Column("spec_version", String(128), nullable=False),
    Column("loss", String(32), nullable=False),
    Column("base_model", Text, nullable=False),
    Column("base_revision", String(64), nullable=False),
    Column("parent_run_id", String(64)),  # the run whose adapter this one continued
    Column("watermark_from", BigInteger, nullable=False),
    Column("watermark_to", BigInteger, nullable=False),
    Column("episodes", Integer, nullable=False),
    Column("adapter_path", Text),
    Column("summary", JSON),  # final metrics and selection counts
    Column("error", Text),
    Column("started_at", DateTime, nullable=False),
    Column("finished_at", DateTime),
)

# A judge's score is expensive: cached per episode and judge version (model + prompt).
judge_scores = Table(
    "judge_scores",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("request_id", ID, nullable=False),
    Column("judge_version", String(128), nullable=False),
    Column("score", Float, nullable=False),
    Column("computed_at", DateTime, nullable=False),
    UniqueConstraint("request_id", "judge_version"),
)

leases = Table(
    "leases",
    metadata,
    Column("name", String(128), primary_key=True),
    Column("owner", String(256), nullable=False),
    Column("expires_at", DateTime, nullable=False),
    Column("heartbeat_at", DateTime, nullable=False),
    # the fencing token: grows whenever the lease changes hands or is re-taken after expiring
    Column("generation", BigInteger, nullable=False, server_default="0"),
)

alias_moves = Table(
    "alias_moves",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("model_name", String(256), nullable=False),
    Column("alias", String(64), nullable=False),
    Column("from_version", String(64)),
    Column("to_version", String(64)),  # None: the alias was cleared (a canary withdrawn)
    Column("reason", Text, nullable=False),
    Column("actor", String(256), nullable=False),  # "automatic" or a named operator
    Column("at", DateTime, nullable=False),
    # written "pending" before the registry call, "done" after it: a crash in between is found
    # and repaired from the registry's state on the next start ("not_applied" if it never moved)
    Column("status", String(16), nullable=False, server_default="done"),
    Column("published_at", DateTime),  # when the model-update event went to Kafka
    Column("share", Float),  # `canary` moves: the share of requests the canary serves
    Column("kind", String(16)),  # promote | rollback | stage | withdraw (None: written before 0009)
)

# Every gate decision with the numbers behind it (also tagged on the registry's model version).
gate_decisions = Table(
    "gate_decisions",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("model_name", String(256), nullable=False),
    Column("candidate_version", String(64), nullable=False, index=True),
    Column("champion_version", String(64)),
    Column("run_id", String(64)),  # training_runs.run_id of the candidate
    Column("passed", Integer, nullable=False),  # 0 / 1 (a boolean both dialects agree on)
    Column("report", JSON, nullable=False),  # checks, both evaluation reports, the comparison
    Column("decided_at", DateTime, nullable=False),
)

# One row per cycle (reward -> train -> evaluate -> gate -> promote), updated as it moves through
# its states; a crashed cycle is resumed from the state it reached (pipeline/cycle.py).
cycles = Table(
    "cycles",
    metadata,
    Column("cycle_id", String(64), primary_key=True),
    Column("state", String(16), nullable=False, index=True),  # pending .. done | rejected | skipped | failed
    Column("reason", Text),  # why it was skipped, rejected or failed
    Column("run_id", String(64)),  # the training run
    Column("candidate_version", String(64)),
    Column("promoted", Integer),  # 0 / 1 once decided
    Column("timings", JSON, nullable=False),  # stage -> seconds
    Column("owner", String(256)),  # the daemon (lease holder) that ran it
    Column("started_at", DateTime, nullable=False),
    Column("updated_at", DateTime, nullable=False),
    Column("finished_at", DateTime),
)

Index("ix_feedback_request_kind", feedback.c.request_id, feedback.c.kind)

EVENT_TABLES = {"interaction": interactions, "feedback": feedback}


def same_episode(
    calls: FromClause, other: FromClause, any_tenant: ColumnElement[bool] | None = None
) -> ColumnElement[bool]:
    """`calls` (interactions) and `other` (interactions, or feedback naming an episode) are of one
    agent episode: the same episode id of the same tenant -- episode ids are the applications',
    and two tenants may both have a "task-7". `any_tenant`: a condition on `other` under which
    its tenant is not named and any tenant's episode of that id matches (feedback's NULL)."""
    tenant = calls.c.tenant == other.c.tenant
    return and_(calls.c.episode_id == other.c.episode_id, tenant if any_tenant is None else or_(any_tenant, tenant))
