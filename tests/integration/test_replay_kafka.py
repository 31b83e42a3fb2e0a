"""Replay from the real broker by time range: idempotent, equal to a file replay, and invisible
to the live consumer group."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from click.testing import CliRunner
from kafka import KafkaProducer

from ingest.ndjson import export_events
from ingest.replay import replay_from_file, replay_from_kafka
from pipeline.cli import cli
from pipeline.core.store import db as store_db
from pipeline.core.store.event_reads import stored_offsets, table_counts
from tests.support.factories import encode, interaction
from tests.support.factories import feedback as fb
from tests.support.stores import event_contents

pytestmark = pytest.mark.kafka

T0 = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)


def _produce_at(bootstrap, topic, items):
    """items: (record time, value bytes), sent in time order as a real producer would."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    for ts, value in sorted(items, key=lambda item: item[0]):
        producer.send(topic, value=value, timestamp_ms=int(ts.timestamp() * 1000))
    producer.flush()
    producer.close()


@pytest.fixture
def history(kafka_bootstrap, topics):
    """60 interactions one minute apart from T0, feedback for each, and two bad records."""
    inter = [(T0 + timedelta(minutes=i), encode(interaction(i, prefix="h"))) for i in range(60)]
    inter.append((T0 + timedelta(minutes=30, seconds=1), b"{not json"))
    feed = [(T0 + timedelta(minutes=i, seconds=30), encode(fb(i, prefix="h"))) for i in range(60)]
    feed.append((T0 + timedelta(minutes=45, seconds=1), encode(fb(99, prefix="h", schema_version=9))))
    _produce_at(kafka_bootstrap, topics["interactions"], inter)
    _produce_at(kafka_bootstrap, topics["feedback"], feed)


def test_replay_time_range_twice_is_identical_and_leaves_the_group_alone(cfg, engine, history):
    since, until = T0 + timedelta(minutes=10), T0 + timedelta(minutes=40)
    dry = replay_from_kafka(cfg, engine, since, until, dry_run=True)
    assert dry.new_events == {"interaction": 30, "feedback": 30} and dry.dead_letters == 1
    assert table_counts(engine)["interactions"] == 0
    first = replay_from_kafka(cfg, engine, since, until)
    assert first.new_events == {"interaction": 30, "feedback": 30} and first.dead_letters == 1
    snapshot = event_contents(engine), table_counts(engine)
    second = replay_from_kafka(cfg, engine, since, until)
    assert second.new_events == {"interaction": 0, "feedback": 0} and second.already_stored == 60
    assert (event_contents(engine), table_counts(engine)) == snapshot
    assert {int(k.split("-")[-1]) for k in snapshot[0] if "-i-" in k} == set(range(10, 40))
    # the live group has no stored positions: replay is not a group member
    assert stored_offsets(engine, cfg.ingest.group_id) == {}


def test_full_kafka_replay_equals_file_replay_and_cli_round_trip(cfg, engine, history, tmp_path, db_url):
    report = replay_from_kafka(cfg, engine)
    assert report.new_events == {"interaction": 60, "feedback": 60} and report.dead_letters == 2
    out = tmp_path / "all.ndjson.gz"
    assert export_events(engine, str(out)) == 120
    other_url = f"sqlite:///{tmp_path / 'copy.db'}"
    store_db.upgrade(other_url)
    other = store_db.make_engine(other_url)
    replay_from_file(cfg, other, str(out))
    assert event_contents(other) == event_contents(engine)
    other.dispose()
    # the same through the CLI: replay twice, the second changes nothing
    env = {"RTRL_DB_URL": other_url, "RTRL_STATE_DIR": str(tmp_path)}
    runner = CliRunner()
    again = runner.invoke(cli, ["replay", "--file", str(out)], env=env)
    assert again.exit_code == 0 and "added 0 interactions and 0 feedback; 120 already stored" in again.output, (
        again.output
    )
    dry = runner.invoke(cli, ["replay", "--file", str(out), "--dry-run"], env=env)
    assert "dry run: read 120; would add 0 interactions" in dry.output, dry.output
