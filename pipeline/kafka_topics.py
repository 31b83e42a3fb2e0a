"""The topics the loop needs on a broker rtrl did not start (managed Kafka): create them with the
settings the loop relies on, or check that existing ones have them.

What each setting guards (`rtrl kafka topics check` names the one a topic breaks):
- `cleanup.policy=delete`: compaction keeps only the newest record per key, and the feedback
  events about one request share its key (accepted, then edited) -- a compacted topic silently
  drops all but the last.
- `retention.ms` >= `--min-retention` (7 days; -1, forever, passes): ingest that is down, or a
  `rtrl replay --since`, reads back only what the topic still holds.
- `max.message.bytes` >= `kafka.max_message_bytes`: what producers are allowed to send; a
  smaller topic limit refuses the large events the gateway and `rtrl serve` record.
- replication factor >= `--min-replication` and, with 3 or more replicas, `min.insync.replicas`
  >= 2: producers wait for acks=all, so an acknowledged event survives one broker's loss.
- partitions >= 1; fewer than `kafka.partitions` is allowed and said: ingest runs at most one
  consumer per partition.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.core import kafka_client
from pipeline.core.config import Config

DEFAULT_MIN_RETENTION_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class TopicNeed:
    """One topic the loop uses and what it must have."""

    name: str
    role: str  # "interactions" | "feedback" | "model updates": the config field that names it
    partitions: int
    max_message_bytes: int


@dataclass
class TopicCheck:
    """What `check` found for one topic: `problems` break the loop's promises, `notes` do not."""

    name: str
    role: str
    exists: bool
    partitions: int = 0
    replication: int = 0
    configs: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def needs(config: Config) -> list[TopicNeed]:
    k = config.kafka
    return [
        TopicNeed(name, role, k.partitions, k.max_message_bytes)
        for name, role in (
            (k.interactions_topic, "interactions"),
            (k.feedback_topic, "feedback"),
            (k.model_updates_topic, "model updates"),
        )
    ]


def _brokers(admin: Any) -> int:
    return len(admin.describe_cluster()["brokers"])


def create(
    config: Config, replication: int | None = None, retention_ms: int = DEFAULT_MIN_RETENTION_MS
) -> tuple[list[str], list[str]]:
    """Create the topics that do not exist; (created, already there). `replication` defaults to
    min(3, the brokers in the cluster)."""
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = kafka_client.admin(config.kafka_access, client_id="rtrl-topics")
    try:
        rf = replication or min(3, _brokers(admin))
        existing = set(admin.list_topics())
        topic_configs = {"cleanup.policy": "delete", "retention.ms": str(retention_ms)}
        if rf >= 3:
            topic_configs["min.insync.replicas"] = "2"
        made, there = [], []
        for need in needs(config):
            if need.name in existing:
                there.append(need.name)
                continue
            new = NewTopic(
                need.name,
                need.partitions,
                rf,
                topic_configs={**topic_configs, "max.message.bytes": str(need.max_message_bytes)},
            )
            try:  # one at a time: a topic another creator made meanwhile is "there", not an error
                admin.create_topics([new], wait_for_metadata=True)  # the next command sees it
                made.append(need.name)
            except TopicAlreadyExistsError:
                there.append(need.name)
        return made, there
    finally:
        admin.close()


def check(
    config: Config, min_replication: int = 1, min_retention_ms: int = DEFAULT_MIN_RETENTION_MS
) -> list[TopicCheck]:
    """Each topic the loop uses, against what it must have (the module docstring says why)."""
    from kafka.admin import ConfigResource, ConfigResourceType

    admin = kafka_client.admin(config.kafka_access, client_id="rtrl-topics")
    try:
        existing = set(admin.list_topics())
        out: list[TopicCheck] = []
        for need in needs(config):
            found = TopicCheck(need.name, need.role, need.name in existing)
            out.append(found)
            if not found.exists:
                found.problems.append("does not exist: `rtrl kafka topics create`")
                continue
            (described,) = admin.describe_topics([need.name])
            parts = described["partitions"]
            found.partitions = len(parts)
            found.replication = min(len(p["replica_nodes"]) for p in parts)
            entries = admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, need.name)], config_filter="all"
            )["topic"][need.name]
            found.configs = {k: str(v["value"]) for k, v in entries.items() if v.get("value") is not None}
            _judge(found, need, min_replication, min_retention_ms)
        return out
    finally:
        admin.close()


def _judge(found: TopicCheck, need: TopicNeed, min_replication: int, min_retention_ms: int) -> None:
    c = found.configs
    policy = c.get("cleanup.policy", "delete")
    if "compact" in policy:
        found.problems.append(f"cleanup.policy={policy}: compaction drops events that share a key; set delete")
    retention = int(c.get("retention.ms", "-1"))
    if retention != -1 and retention < min_retention_ms:
        found.problems.append(
            f"retention.ms={retention} ({retention / 3.6e6:.1f} h) is under {min_retention_ms / 3.6e6:.0f} h: "
            "events are gone before an ingest outage or a replay can read them"
        )
    limit = int(c.get("max.message.bytes", "0"))
    if limit < need.max_message_bytes:
        found.problems.append(
            f"max.message.bytes={limit} is under kafka.max_message_bytes={need.max_message_bytes}: the broker "
            "refuses events producers may send"
        )
    if found.replication < min_replication:
        found.problems.append(f"replication factor {found.replication} is under {min_replication}")
    insync = int(c.get("min.insync.replicas", "1"))
    if found.replication >= 3 and insync < 2:
        found.problems.append(
            f"min.insync.replicas={insync} with {found.replication} replicas: an acknowledged event is lost "
            "with one broker; set 2"
        )
    if found.partitions < need.partitions:
        found.notes.append(
            f"{found.partitions} partitions (kafka.partitions is {need.partitions}): at most "
            f"{found.partitions} ingest consumers share the work"
        )
