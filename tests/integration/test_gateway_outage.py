"""`rtrl gateway` as users run it -- its own process, a real broker of its own, requests arriving
all the while -- through a 30 s broker outage and a kill -9: every event of every answered
request reaches Kafka, exactly once after ingest's dedupe by event id (write-ahead spool:
deploy/serving/events.py; the gateway keeps an answer's event before it gives the answer)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest
import requests

from tests.support.helpers import REPO, free_port, wait_for
from tests.support.servers import InProcessServer
from tests.support.vllm_instant import instant_vllm_app

pytestmark = pytest.mark.kafka
OUTAGE_S = 30.0


class GatewayProcess:
    def __init__(self, upstream: str, port: int, env: dict[str, str], log_path) -> None:
        self.url, self.log_path = f"http://127.0.0.1:{port}", log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "gateway", "--upstream", upstream, "--port", str(port)],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_for(self.healthy, 90, "the gateway to start")

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=2).ok
        except requests.ConnectionError:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            return False


class Load:
    """One client sending chat requests back to back; what was answered, and when, and how many
    requests got no answer (refused, timed out, cut off by the kill)."""

    def __init__(self, url: str) -> None:
        self.url, self.answered, self.stop = url, [], threading.Event()
        self.unanswered = 0
        self.http = requests.Session()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        body = {"model": "policy", "messages": [{"role": "user", "content": "reverse abc"}], "max_tokens": 3}
        while not self.stop.is_set():
            try:
                answer = self.http.post(self.url + "/v1/chat/completions", json=body, timeout=10)
            except requests.RequestException:
                self.unanswered += 1  # the gateway is down (killed), or the answer came too late
                continue
            if answer.ok:
                self.answered.append((answer.headers["X-Request-Id"], time.monotonic()))
            else:
                self.unanswered += 1

    def count(self) -> int:
        return len(self.answered)


def test_no_event_is_lost_through_a_broker_outage_and_a_kill_9_under_load(tmp_path):
    from kafka import KafkaConsumer

    from pipeline import kafka_local
    from pipeline.core.config import load_config

    env = {
        **os.environ,
        "RTRL_STATE_DIR": str(tmp_path / "state"),
        "RTRL_KAFKA__PORT": str(free_port()),
        "RTRL_KAFKA__CONTROLLER_PORT": str(free_port()),
    }
    cfg = load_config(environ=env)
    kafka_local.up(cfg, progress=lambda _: None)
    upstream = InProcessServer(instant_vllm_app())
    gateway = load = None
    try:
        kafka_local.ensure_topics(
            cfg.kafka_access,
            [cfg.kafka.interactions_topic, cfg.kafka.feedback_topic, cfg.kafka.model_updates_topic],
            partitions=2,
        )
        port = free_port()
        gateway = GatewayProcess(upstream.url, port, env, tmp_path / "gateway.log")
        load = Load(gateway.url)
        wait_for(lambda: load.count() >= 100, 60, "answers with the broker up")
        kafka_local.down(cfg)
        during = load.count()
        end = time.monotonic() + OUTAGE_S
        wait_for(lambda: time.monotonic() >= end, OUTAGE_S + 5, "the outage's end")  # load goes on meanwhile
        assert load.count() > during + 100  # answers went on without the broker
        kafka_local.up(cfg, progress=lambda _: None)
        before_kill = load.count()
        wait_for(lambda: load.count() >= before_kill + 200, 60, "answers with the broker back")
        gateway.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        gateway.proc.wait(10)
        load.stop.set()
        load.thread.join(15)
        gateway = GatewayProcess(upstream.url, port, env, tmp_path / "gateway.log")  # sends what its spool holds

        must = {rid for rid, _ in load.answered}  # the answers received until the kill, and after it
        seen: dict[str, set[str]] = defaultdict(set)
        consumer = KafkaConsumer(
            cfg.kafka.interactions_topic,
            bootstrap_servers=cfg.bootstrap,
            auto_offset_reset="earliest",
            consumer_timeout_ms=2000,
        )
        try:

            def all_there() -> bool:
                for message in consumer:
                    event = json.loads(message.value)
                    seen[event["request_id"]].add(event["event_id"])
                return must <= seen.keys()

            try:
                wait_for(all_there, 120, "every answered request's event in Kafka")
            except AssertionError:
                missing = sorted(killed_at - at for rid, at in load.answered if rid in must - seen.keys())
                raise AssertionError(
                    f"{len(missing)} of {len(must)} answered requests have no event; answered "
                    f"{missing[:5]}..{missing[-5:]} s before the kill; the gateway's log ends:\n"
                    + gateway.log_path.read_text()[-3000:]
                ) from None
        finally:
            consumer.close()
        assert len(must) > 500
        assert all(len(ids) == 1 for ids in seen.values())  # exactly once after dedupe by event id
        # The gateway spools a request's event before it answers (so that nothing answered is
        # lost): a request in flight at the kill, or one the client gave up on, may have an
        # event without an answer. One client sends one request at a time, so each request it
        # got no answer for accounts for at most one event; anything beyond would be forged.
        assert len(set(seen) - must) <= load.unanswered
    finally:
        if load is not None:
            load.stop.set()
        if gateway is not None:
            gateway.proc.kill()
        upstream.stop()
        kafka_local.down(cfg)
