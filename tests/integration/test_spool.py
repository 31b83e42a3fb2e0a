"""The spool against real failures: a kill -9 loses nothing appended, events sent while the broker
is away reach it in order once it is back, and an event too large for the topic is set aside."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from pipeline.core.spool import Spool
from tests.support.helpers import REPO, wait_for
from tests.support.spool import drained_values


def test_a_process_killed_mid_appends_loses_nothing_it_appended(tmp_path):
    """The child appends numbered records and writes the count it has appended to stdout every
    50 records, with no pause; killed with SIGKILL, the spool must hold every record counted
    (append hands each record to the OS: only a machine that goes down loses the last group-commit
    interval, which a process kill cannot show)."""
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"""
from pathlib import Path
from pipeline.core.spool import Spool
spool = Spool(Path({str(tmp_path)!r}), commit_s=1.0)
i = 0
while True:
    spool.append("t", b"k", ('{{"i": %d}}' % i).encode())
    i += 1
    if i % 50 == 0:
        print(i, flush=True)
""",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        durable = 0
        for line in child.stdout:  # (the child writes a line every 50 appends: this read never waits long)
            durable = int(line)
            if durable >= 2000:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    got = drained_values(Spool(tmp_path))
    assert got[:durable] == list(range(durable))


@pytest.mark.kafka
def test_events_sent_while_the_broker_is_away_reach_it_in_order_once_it_is_back(tmp_path):
    """A broker of its own, stopped between two bursts of events and started again: the sender
    answers every call (spooling), and the topic ends up with every event, in the order they were
    sent (at least once: a record sent again after a failed try is a duplicate ingest drops by
    its event id)."""
    from kafka import KafkaConsumer

    from deploy.serving.events import EventSender
    from pipeline import kafka_local
    from pipeline.core.config import load_config
    from tests.support.helpers import free_port

    cfg = load_config(
        environ={
            "RTRL_STATE_DIR": str(tmp_path / "state"),
            "RTRL_KAFKA__PORT": str(free_port()),
            "RTRL_KAFKA__CONTROLLER_PORT": str(free_port()),
        }
    )
    kafka_local.up(cfg, progress=lambda _: None)
    sender = None
    try:
        kafka_local.ensure_topics(cfg.kafka_access, ["spooled"], partitions=1)
        sender = EventSender(
            cfg.kafka_access, "spooled", key="request_id", timeout_s=3.0, spool=Spool(tmp_path / "spool"), retry_s=0.5
        )
        for i in range(10):
            sender({"request_id": f"r{i}", "i": i})
        kafka_local.down(cfg)
        for i in range(10, 40):  # the first waits out the send timeout, the rest go straight to the spool
            sender({"request_id": f"r{i}", "i": i})
        assert sender.spool.pending()
        kafka_local.up(cfg, progress=lambda _: None)
        wait_for(lambda: not sender.spool.pending(), 120, "the spool to drain")
        consumer = KafkaConsumer(
            "spooled", bootstrap_servers=cfg.bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=5000
        )
        got = [json.loads(m.value)["i"] for m in consumer]
        consumer.close()
        assert list(dict.fromkeys(got)) == list(range(40)), got  # each event's first arrival, in order
    finally:
        if sender is not None:
            sender.close()
        kafka_local.down(cfg)


@pytest.mark.kafka
@pytest.mark.parametrize("producer_limit", [1 << 20, 4 << 20], ids=["producer-refuses", "broker-refuses"])
def test_an_event_too_large_for_the_topic_is_set_aside_and_the_events_behind_it_arrive(
    tmp_path, kafka_bootstrap, producer_limit
):
    """A 1 MiB topic and a 2 MiB event, refused by the producer (max_request_size) or, past a
    4 MiB producer limit, by the broker: it was retried every 2 s with every later event waiting
    behind it; now it is set aside and the others arrive."""
    import uuid

    from kafka import KafkaConsumer

    from deploy.serving.events import EventSender
    from pipeline.core.kafka_config import KafkaAccess
    from pipeline.kafka_local import ensure_topics

    topic = f"sized-{uuid.uuid4().hex[:8]}"
    ensure_topics(KafkaAccess(kafka_bootstrap), [topic], partitions=1)  # max.message.bytes: 1 MiB
    sender = EventSender(
        KafkaAccess(kafka_bootstrap, max_message_bytes=producer_limit),
        topic,
        key="request_id",
        timeout_s=5.0,
        spool=Spool(tmp_path / "spool"),
        retry_s=0.2,
        write_ahead=True,
    )
    try:
        for i in range(4):
            sender({"request_id": f"r{i}", "i": i, "pad": "x" * ((2 << 20) if i == 1 else 0)})
        wait_for(lambda: not sender.spool.pending(), 60, "the spool to drain past the large event")
        assert sender.spool.set_aside == 1
        aside = json.loads((tmp_path / "spool" / "set-aside.jsonl").read_text())
        assert aside["key"] == "r1" and "MessageSizeTooLarge" in aside["error"]
    finally:
        sender.close()
    consumer = KafkaConsumer(
        topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=3000
    )
    got = [json.loads(m.value)["i"] for m in consumer]
    consumer.close()
    assert list(dict.fromkeys(got)) == [0, 2, 3]  # each event's first arrival (a batch sent again one by one
