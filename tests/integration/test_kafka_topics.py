"""`rtrl kafka topics create|check` on a real broker: created topics pass the check; a topic
that compacts, keeps events for an hour or refuses large records fails it, naming each setting."""

from __future__ import annotations

import uuid

import pytest
from click.testing import CliRunner

from pipeline.cli import cli

pytestmark = pytest.mark.kafka


def _env(kafka_bootstrap: str, tmp_path) -> dict[str, str]:
    p = f"k-{uuid.uuid4().hex[:8]}"
    return {
        "RTRL_STATE_DIR": str(tmp_path),
        "RTRL_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "RTRL_KAFKA__INTERACTIONS_TOPIC": f"{p}.interactions",
        "RTRL_KAFKA__FEEDBACK_TOPIC": f"{p}.feedback",
        "RTRL_KAFKA__MODEL_UPDATES_TOPIC": f"{p}.model-updates",
        "RTRL_KAFKA__PARTITIONS": "2",
    }


def test_created_topics_pass_the_check_and_a_second_create_leaves_them(kafka_bootstrap, tmp_path):
    env = _env(kafka_bootstrap, tmp_path)
    runner = CliRunner()
    missing = runner.invoke(cli, ["kafka", "topics", "check"], env=env)
    assert missing.exit_code == 1 and missing.output.count("does not exist") == 3, missing.output
    made = runner.invoke(cli, ["kafka", "topics", "create", "--retention", "30d"], env=env)
    assert made.exit_code == 0 and made.output.count("created ") == 3, made.output
    again = runner.invoke(cli, ["kafka", "topics", "create"], env=env)
    assert again.exit_code == 0 and again.output.count("left as it is") == 3, again.output
    ok = runner.invoke(cli, ["kafka", "topics", "check", "--min-retention", "30d"], env=env)
    assert ok.exit_code == 0 and ok.output.count("ok   ") == 3 and "2 partitions, replication 1" in ok.output


def test_a_topic_that_would_lose_or_refuse_events_fails_the_check_naming_each_setting(kafka_bootstrap, tmp_path):
    from kafka.admin import NewTopic

    from pipeline.core import kafka_client
    from pipeline.core.config import load_config

    env = _env(kafka_bootstrap, tmp_path)
    cfg = load_config(environ=env)
    admin = kafka_client.admin(cfg.kafka_access, client_id="test")
    bad = {"cleanup.policy": "compact", "retention.ms": str(3600_000), "max.message.bytes": "1000"}
    admin.create_topics([NewTopic(cfg.kafka.feedback_topic, 1, 1, topic_configs=bad)])
    admin.close()
    assert CliRunner().invoke(cli, ["kafka", "topics", "create"], env=env).exit_code == 0  # makes the other two
    out = CliRunner().invoke(cli, ["kafka", "topics", "check"], env=env)
    assert out.exit_code == 1, out.output
    feedback = out.output[out.output.index(f"FAIL {cfg.kafka.feedback_topic}") :]
    assert "cleanup.policy=compact" in feedback and "retention.ms=3600000 (1.0 h) is under 168 h" in feedback
    assert "max.message.bytes=1000 is under kafka.max_message_bytes=1048576" in feedback
    assert "note: 1 partitions (kafka.partitions is 2)" in feedback
    assert out.output.count("ok   ") == 2
