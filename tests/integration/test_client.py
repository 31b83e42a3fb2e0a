"""The client library (pipeline/client.py): importable without the ML stack; through a real
`rtrl gateway` (uvicorn on a socket) and straight to the real broker; events checked by the
contract's models before they leave; a spool per process while the broker is away."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from deploy.serving.gateway import Gateway
from deploy.serving.gateway_api import create_gateway_app
from pipeline.client import Rtrl
from pipeline.core.spool import SpoolBusy
from tests.support.helpers import free_port, wait_for
from tests.support.servers import InProcessServer


def test_importing_the_client_loads_no_ml_stack(tmp_path):
    code = (
        "import sys; from pipeline.client import Rtrl; "
        f"Rtrl(bootstrap='127.0.0.1:9', spool_dir={str(tmp_path)!r}).close(); "
        "print(sorted(m for m in ('torch', 'transformers', 'mlflow', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_exactly_one_transport():
    with pytest.raises(ValueError, match="exactly one"):
        Rtrl()
    with pytest.raises(ValueError, match="exactly one"):
        Rtrl("http://127.0.0.1:9", bootstrap="127.0.0.1:9")


@pytest.fixture
def gateway():
    interactions, feedback = [], []
    gw = Gateway("http://127.0.0.1:9", "policy", interactions.append, feedback.append, ingest_token="s3cret")
    server = InProcessServer(create_gateway_app(gw))
    yield server.url, interactions, feedback
    server.stop()


def test_through_the_gateway(gateway):
    url, interactions, feedback = gateway
    with Rtrl(gateway_url=url, token="s3cret") as rtrl:
        request_id = rtrl.interaction(
            prompt=[{"role": "user", "content": "reverse abc"}],
            completion="cba",
            policy_version="3",
            episode_id="task-1",
            step=0,
            completion_token_ids=[5, 6],
            behavior_logprobs=[-0.1, -0.2],
            sampling={"temperature": 1.0},
        )
        first = rtrl.feedback(request_id, kind="accepted", value=True)
        rtrl.episode_outcome("task-1", kind="persisted", value=True, payload={"tests": "passed"})
        # refused here, before it leaves, naming the field
        with pytest.raises(ValueError, match="value"):
            rtrl.feedback(request_id, kind="accepted", value="yes")
        with pytest.raises(ValueError, match="policy_version"):
            rtrl.interaction(prompt="p", completion="c", policy_version="")
    wait_for(lambda: interactions, 10, "the interaction event")
    assert interactions[0]["request_id"] == request_id and interactions[0]["episode_id"] == "task-1"
    assert feedback[0] == {**feedback[0], "request_id": request_id, "event_id": first, "kind": "accepted"}
    assert feedback[1]["episode_id"] == "task-1" and "request_id" not in feedback[1]
    assert feedback[1]["payload"] == {"tests": "passed"} and len(feedback) == 2


def test_a_gateway_that_is_away_is_a_connection_error():
    with Rtrl(gateway_url=f"http://127.0.0.1:{free_port()}", timeout_s=2) as rtrl:
        with pytest.raises(ConnectionError, match="is `rtrl gateway` running there"):
            rtrl.feedback("r-1", kind="accepted", value=True)


def test_one_process_per_spool_and_events_wait_there_while_the_broker_is_away(tmp_path):
    with Rtrl(bootstrap=f"127.0.0.1:{free_port()}", spool_dir=tmp_path, timeout_s=1) as rtrl:
        rtrl.episode_outcome("task-9", kind="persisted", value=False)  # no broker: spooled, not lost
        assert rtrl.senders["feedback"].spool.pending()
        with pytest.raises(SpoolBusy, match="its own spool directory"):
            Rtrl(bootstrap="127.0.0.1:9", spool_dir=tmp_path)
    assert any(p.suffix == ".spool" and p.stat().st_size for p in (tmp_path / "feedback").iterdir())


@pytest.mark.kafka
def test_straight_to_kafka(kafka_bootstrap, topics, tmp_path):
    from kafka import KafkaConsumer

    with Rtrl(
        bootstrap=kafka_bootstrap,
        interactions_topic=topics["interactions"],
        feedback_topic=topics["feedback"],
        spool_dir=tmp_path,
    ) as rtrl:
        request_id = rtrl.interaction(prompt="reverse abc", completion="cba", policy_version="3", episode_id="task-2")
        rtrl.feedback(request_id, kind="accepted", value=True)
        rtrl.episode_outcome("task-2", kind="persisted", value=True)
        assert not any(s.spool.pending() for s in rtrl.senders.values())  # the broker has them

    def read(topic: str) -> list[tuple[bytes, dict]]:
        consumer = KafkaConsumer(
            topic, bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest", consumer_timeout_ms=3000
        )
        got = [(m.key, json.loads(m.value)) for m in consumer]
        consumer.close()
        return got

    ((key, interaction),) = read(topics["interactions"])
    assert key == request_id.encode() and interaction["episode_id"] == "task-2"
    keys = sorted(k for k, _ in read(topics["feedback"]))
    assert keys == sorted([request_id.encode(), b"task-2"])  # an episode's outcome is keyed by the episode


def _full_sender(tmp_path, when_full):
    """An event sender whose broker is away and whose spool holds one event: the next is refused
    (or, with `block`, waits)."""
    from deploy.serving.events import EventSender
    from pipeline.core.spool import Spool

    spool = Spool(tmp_path / when_full, max_bytes=1500, when_full=when_full)
    sender = EventSender(
        "127.0.0.1:9", "rtrl.feedback", key="request_id", timeout_s=1.0, spool=spool, retry_s=60.0, write_ahead=True
    )
    sender({"request_id": "r0", "pad": "x" * 1300})
    return sender


def test_a_full_spool_is_a_503_never_a_202_and_the_client_is_told(tmp_path):
    sender = _full_sender(tmp_path, "refuse")
    gw = Gateway("http://127.0.0.1:9", "policy", sender, sender, ingest_token="s3cret")
    server = InProcessServer(create_gateway_app(gw))
    try:
        with Rtrl(gateway_url=server.url, token="s3cret") as rtrl:
            with pytest.raises(ConnectionError, match="could not keep the feedback event.*retry in 30 s"):
                rtrl.feedback("req-1", kind="accepted", value=True)
            with pytest.raises(ConnectionError, match="could not keep the interaction event"):
                rtrl.interaction(prompt="p", completion="c", policy_version="3")
        assert gw.metrics.get_sample_value("rtrl_gateway_events_total", {"type": "feedback", "outcome": "lost"}) == 1
    finally:
        server.stop()
        sender.close()


def test_a_spool_that_blocks_when_full_does_not_freeze_the_gateway(tmp_path):
    """`when_full = "block"`: the feedback waits for room, in a thread -- /health still answers."""
    import threading

    import requests

    sender = _full_sender(tmp_path, "block")
    gw = Gateway("http://127.0.0.1:9", "policy", sender, sender, blocking=True, ingest_token="s3cret")
    server = InProcessServer(create_gateway_app(gw))
    answers: list[int] = []
    try:
        waiting = threading.Thread(
            target=lambda: answers.append(
                requests.post(
                    f"{server.url}/v1/feedback",
                    json={"request_id": "r1", "kind": "accepted", "value": True},
                    headers={"Authorization": "Bearer s3cret"},
                    timeout=60,
                ).status_code
            ),
            daemon=True,
        )
        waiting.start()
        wait_for(lambda: sender.spool.waiting, 30, "the feedback to wait for room in the spool")
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200 and answers == []
        sender.spool.drain(lambda *record: None)  # the broker back: room, and the feedback is kept
        waiting.join(timeout=30)
        assert answers == [202]
    finally:
        server.stop()
        sender.close()


def test_the_ingestion_routes_take_events_only_with_the_gateway_s_token(gateway, monkeypatch):
    """Anyone who can reach the gateway could otherwise post an interaction under another user's
    request id, or feedback on it; request ids cannot be guessed from the ones a client saw."""
    url, interactions, feedback = gateway
    for token in (None, "wrong"):
        monkeypatch.delenv("RTRL_GATEWAY_TOKEN", raising=False)
        with Rtrl(gateway_url=url, token=token) as rtrl, pytest.raises(PermissionError, match="Authorization"):
            rtrl.feedback("req-1", kind="accepted", value=True)
    monkeypatch.setenv("RTRL_GATEWAY_TOKEN", "s3cret")  # the client's default
    with Rtrl(gateway_url=url) as rtrl:
        rtrl.feedback("req-1", kind="accepted", value=True)
    assert len(feedback) == 1
    off = InProcessServer(create_gateway_app(Gateway("http://127.0.0.1:9", "policy", None, None)))
    try:
        import requests

        answer = requests.post(
            f"{off.url}/v1/feedback",
            json={"request_id": "r", "kind": "k", "value": 1},
            headers={"Authorization": "Bearer anything"},
            timeout=10,
        )
        assert answer.status_code == 403 and "RTRL_GATEWAY_TOKEN" in answer.json()["error"]["message"]
    finally:
        off.stop()
    from deploy.serving.gateway import new_id

    ids = [new_id("req") for _ in range(3)]
    assert len({i[4:12] for i in ids}) == 3 and all(len(i) == 36 for i in ids)  # no shared prefix, no counter


def test_a_process_forked_after_the_client_was_built_is_told_to_build_its_own(tmp_path):
    """A pre-forking server that built Rtrl(...) before forking: the child shared the parent's
    spool lock and files, and had no thread to send what it appended (half the events lost)."""
    import os

    rtrl = Rtrl(bootstrap="127.0.0.1:9", spool_dir=tmp_path, timeout_s=1.0)
    try:
        pid = os.fork()
        if pid == 0:  # the child: its first event is refused, naming the fix
            try:
                rtrl.feedback("req-1", kind="accepted", value=True)
                os._exit(3)
            except SpoolBusy as exc:
                os._exit(0 if "after the fork" in str(exc) else 4)
            except BaseException:  # noqa: BLE001 - anything else: a distinct exit code
                os._exit(5)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not rtrl.senders["feedback"].spool.pending()  # the parent's spool untouched
    finally:
        rtrl.close()


def test_an_error_page_in_front_of_the_gateway_is_a_connection_error_not_an_invalid_event():
    """A load balancer's 503 has an HTML body: reading it as the gateway's JSON raised a
    ValueError, which the client documents as "the event is invalid" -- an app would drop it."""
    from tests.support.vllm_instant import read_body

    async def balancer(scope, receive, send):
        if scope["type"] != "http":
            return
        await read_body(receive)
        await send({"type": "http.response.start", "status": 503, "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": b"<html><body>no healthy upstream</body></html>"})

    server = InProcessServer(balancer)
    try:
        with (
            Rtrl(gateway_url=server.url, token="t") as rtrl,
            pytest.raises(ConnectionError, match="no healthy upstream"),
        ):
            rtrl.feedback("req-1", kind="accepted", value=True)
    finally:
        server.stop()
