"""`rtrl kafka up --secure` runs a broker like a managed one (SASL_SSL: TLS with a client
certificate, then a SCRAM login). Against that broker: ingest and replay (SQLite and
PostgreSQL), `rtrl serve`'s interaction events and a model-update round trip (a promotion
published, followed by serving), and every wrong setting failing within seconds with a message
that names it."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from deploy.registry import Registry
from deploy.serving.events import EventSender, ModelUpdatePublisher
from deploy.serving.follow import Follower
from deploy.tracking import MlflowTracker
from ingest.consumer import run_ingest
from ingest.replay import replay_from_kafka
from pipeline import kafka_secure
from pipeline.cli import cli
from pipeline.core import kafka_client
from pipeline.core.config import load_config
from pipeline.core.kafka_config import KafkaAccess, KafkaSecurityConfig, security_env
from pipeline.core.store import db as store_db
from pipeline.core.store.event_reads import table_counts
from pipeline.kafka_local import ensure_topics
from tests.support.factories import feedback, interaction
from tests.support.helpers import free_port, wait_for
from tests.support.servers import ServeProcess


@pytest.fixture(scope="module")
def secure(tmp_path_factory):
    """`rtrl kafka up --secure` on free ports: its bootstrap, client settings and their environment."""
    env = {
        "RTRL_STATE_DIR": str(tmp_path_factory.mktemp("secure-kafka")),
        "RTRL_KAFKA__PORT": str(free_port()),
        "RTRL_KAFKA__CONTROLLER_PORT": str(free_port()),
    }
    up = CliRunner().invoke(cli, ["kafka", "up", "--secure"], env=env)
    assert up.exit_code == 0, up.output
    state = Path(env["RTRL_STATE_DIR"]) / "kafka"
    password = (state / "secrets" / "rtrl").read_text().strip()
    assert password not in up.output and "RTRL_KAFKA__SECURITY__PASSWORD_FILE" in up.output
    bootstrap = f"127.0.0.1:{env['RTRL_KAFKA__PORT']}"
    sec = kafka_secure.client_security(state)
    try:
        yield {
            "bootstrap": bootstrap,
            "security": sec,
            "access": KafkaAccess(bootstrap, sec, 5.0),
            "env": {"RTRL_KAFKA_BOOTSTRAP": bootstrap, **security_env(sec)},
            "password": password,
            "broker_env": env,
        }
    finally:
        CliRunner().invoke(cli, ["kafka", "down"], env=env)


def _topics(access, *kinds: str) -> dict[str, str]:
    names = {k: f"s-{uuid.uuid4().hex[:8]}.{k}" for k in kinds}
    ensure_topics(access, list(names.values()), partitions=2)
    return names


@pytest.mark.kafka
def test_ingest_and_replay_over_sasl_ssl(secure, db_url, tmp_path):
    topics = _topics(secure["access"], "interactions", "feedback")
    cfg = load_config(
        environ={
            **secure["env"],
            "RTRL_STATE_DIR": str(tmp_path),
            "RTRL_DB_URL": db_url,
            "RTRL_KAFKA__INTERACTIONS_TOPIC": topics["interactions"],
            "RTRL_KAFKA__FEEDBACK_TOPIC": topics["feedback"],
            "RTRL_INGEST__GROUP_ID": f"g-{uuid.uuid4().hex[:8]}",
            "RTRL_INGEST__SESSION_TIMEOUT_MS": "6000",
        }
    )
    n, prefix = 60, uuid.uuid4().hex[:6]
    for topic, events in (
        (topics["interactions"], [interaction(i, prefix=prefix) for i in range(n)]),
        (topics["feedback"], [feedback(i, prefix=prefix) for i in range(n)]),
    ):
        send = EventSender(cfg.kafka_access, topic, key="request_id")
        for ev in events:
            send(ev)
        send.close()
    engine = store_db.make_engine(db_url)
    try:
        stats = run_ingest(cfg, engine, threading.Event(), max_records=2 * n, idle_exit_s=20)
        assert (stats.events, stats.dead_letters) == (2 * n, 0)
        counts = table_counts(engine)
        assert (counts["interactions"], counts["feedback"]) == (n, n)
        report = replay_from_kafka(cfg, engine)
        assert report.already_stored == 2 * n and sum(report.new_events.values()) == 0
    finally:
        engine.dispose()


@pytest.mark.kafka
def test_serving_events_and_a_model_update_round_trip_over_sasl_ssl(secure, reverse_base, tmp_path):
    """A promotion published over SASL_SSL is followed by `rtrl serve` (itself a secure client),
    whose interaction events come back over SASL_SSL naming the version that served them."""
    from tests.support.adapters import make_adapter

    access = secure["access"]
    topics = _topics(access, "updates", "interactions")
    url, tracking = f"sqlite:///{tmp_path / 'rtrl.db'}", f"sqlite:///{tmp_path / 'mlflow.db'}"
    store_db.upgrade(url)
    engine = store_db.make_engine(url)
    name = f"policy-{uuid.uuid4().hex[:6]}"
    publisher = ModelUpdatePublisher(access, topics["updates"])
    registry = Registry(tracking, name, engine, publisher)
    for seed in (1, 2):
        tracker = MlflowTracker(tracking, "secure-test", tmp_path / "artifacts")
        tracker.log_artifacts(make_adapter(reverse_base, tmp_path / f"adapter-{seed}", seed), "adapter")
        tracker.end("FINISHED")
        registry.register(tracker.run_id, {"base_model": str(reverse_base)})
    registry.promote("1", actor="test", reason="start", force=True)
    env = {
        **os.environ,
        **secure["env"],
        "RTRL_STATE_DIR": str(tmp_path / "state"),
        "RTRL_DB_URL": url,
        "RTRL_MLFLOW__TRACKING_URI": tracking,
        "RTRL_MLFLOW__REGISTERED_MODEL": name,
        "RTRL_KAFKA__MODEL_UPDATES_TOPIC": topics["updates"],
        "RTRL_KAFKA__INTERACTIONS_TOPIC": topics["interactions"],
    }
    log_path = tmp_path / "serve.log"
    server = ServeProcess(reverse_base, env, log_path)
    base_url, health = server.url, server.health

    def complete(i: int) -> str:
        resp = requests.post(
            f"{base_url}/v1/completions",
            timeout=30,
            json={"prompt": "abc>", "max_tokens": 3, "temperature": 1.0, "seed": i},
        )
        assert resp.status_code == 200, resp.text
        return resp.json()["id"]

    try:
        assert wait_for(health, 120, "rtrl serve to start")["version"] == "1"
        served = {complete(i): "1" for i in range(3)}
        registry.promote("2", actor="test", reason="next", force=True)  # published over SASL_SSL
        wait_for(lambda: health()["version"] == "2", 60, "serving to follow the promotion")
        served.update({complete(i): "2" for i in range(3, 6)})
    finally:
        server.stop()
        publisher.close()
        engine.dispose()
    consumer = kafka_client.consumer(access, group_id=None, auto_offset_reset="earliest", consumer_timeout_ms=2000)
    consumer.subscribe([topics["interactions"]])
    events: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(events) < len(served) and time.monotonic() < deadline:
        for rec in consumer:
            ev = json.loads(rec.value)
            events[ev["request_id"]] = ev["policy_version"]
    consumer.close()
    assert events == served
    assert secure["password"] not in log_path.read_text()


@pytest.mark.kafka
def test_a_follower_over_sasl_ssl_acts_on_a_published_move(secure):
    access = secure["access"]
    topic = _topics(access, "updates")["updates"]
    seen: list[dict] = []
    follower = Follower(
        access,
        topic,
        "m",
        seen.append,
        resolve=lambda alias: {"alias": alias, "version": "7", "adapter_uri": "runs:/r/adapter"},
    ).start()
    try:
        ModelUpdatePublisher(access, topic)({"type": "model_update", "name": "m", "alias": "champion", "version": "7"})
        wait_for(lambda: seen, 30, "the follower to act on the move")
    finally:
        follower.close()
    assert seen[0]["version"] == "7"


def _broken(sec: KafkaSecurityConfig, tmp_path: Path, case: str) -> KafkaSecurityConfig:
    wrong = tmp_path / "wrong-password"
    wrong.write_text("not-the-password\n")
    return {
        "wrong password": lambda: sec.model_copy(update={"password_file": wrong}),
        "wrong user": lambda: sec.model_copy(update={"username": "mallory"}),
        "untrusted certificate": lambda: sec.model_copy(update={"ca_file": None}),
        "no client certificate": lambda: sec.model_copy(update={"cert_file": None, "key_file": None}),
        "plain text to a TLS port": lambda: KafkaSecurityConfig(),
        "TLS without the SASL login": lambda: KafkaSecurityConfig(
            protocol="SSL", ca_file=sec.ca_file, cert_file=sec.cert_file, key_file=sec.key_file
        ),
    }[case]()


@pytest.mark.kafka
@pytest.mark.parametrize(
    "case, named",
    [
        ("wrong password", "kafka.security.password_file"),
        ("wrong user", "kafka.security.username 'mallory'"),
        ("untrusted certificate", "kafka.security.ca_file"),
        ("no client certificate", "kafka.security.cert_file"),
        ("plain text to a TLS port", "kafka.security.protocol is PLAINTEXT: set it to SSL or SASL_SSL"),
        ("TLS without the SASL login", "set it to SASL_SSL"),
    ],
)
def test_wrong_settings_fail_within_seconds_naming_the_setting(secure, tmp_path, case, named):
    access = KafkaAccess(secure["bootstrap"], _broken(secure["security"], tmp_path, case), connect_timeout_s=3.0)
    # every kind of client goes through the same diagnosis: all three for one case, a consumer for the rest
    makers = (
        (kafka_client.consumer, kafka_client.producer, kafka_client.admin)
        if case == "wrong password"
        else (kafka_client.consumer,)
    )
    for make in makers:
        started = time.monotonic()
        with pytest.raises(kafka_client.KafkaAccessError) as err:
            make(access)
        # a bound against a hang (the timeout is 3 s; kafka-python alone waits 30 s), not a benchmark
        assert time.monotonic() - started < 20
        assert named in str(err.value), str(err.value)


@pytest.mark.kafka
def test_the_cli_names_the_setting_and_status_shows_no_secret(secure, tmp_path):
    db = f"sqlite:///{tmp_path / 'rtrl.db'}"
    store_db.upgrade(db)
    env = {**secure["env"], "RTRL_STATE_DIR": str(tmp_path), "RTRL_DB_URL": db, "RTRL_KAFKA__CONNECT_TIMEOUT_S": "3"}
    bad = CliRunner().invoke(
        cli,
        ["ingest", "--idle-exit", "1"],
        env={**env, "RTRL_KAFKA__SECURITY__PASSWORD_FILE": str(_write(tmp_path / "pw", "nope"))},
    )
    assert bad.exit_code == 1 and "kafka.security.password_file" in bad.output, bad.output
    status = CliRunner().invoke(cli, ["status"], env=env)
    assert status.exit_code == 0, status.output
    assert f"{secure['bootstrap']} (SASL_SSL, SCRAM-SHA-512 as rtrl)" in status.output and "total lag" in status.output
    assert secure["password"] not in status.output


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.kafka
def test_the_client_library_is_told_of_wrong_credentials_instead_of_spooling_them(secure, tmp_path):
    """A wrong password was taken for an outage: events spooled silently until the spool was full."""
    from pipeline.client import Rtrl

    access = KafkaAccess(secure["bootstrap"], _broken(secure["security"], tmp_path, "wrong password"), 3.0)
    with Rtrl(bootstrap=access, spool_dir=tmp_path / "spool") as rtrl:
        with pytest.raises(PermissionError, match="kafka.security.password_file"):
            rtrl.feedback("req-1", kind="accepted", value=True)
        assert not rtrl.senders["feedback"].spool.pending()
