"""Shared fixtures: one real Kafka broker per session, and stores on SQLite and PostgreSQL.

- Kafka: `RTRL_KAFKA_BOOTSTRAP` when set, else a broker started through `pipeline.kafka_local`
  (the same code as `rtrl kafka up`) on free ports under a temporary state folder.
- PostgreSQL: `RTRL_TEST_POSTGRES` is a URL of a database whose role may CREATE DATABASE;
  each test gets a fresh database. Outside CI the PostgreSQL cases skip when it is unset; in
  CI (CI=true) they fail instead, so a missing PostgreSQL can never pass silently.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pipeline.core.config import Config, load_config
from pipeline.core.store import db as store_db
from tests.scratch_db import scratch_database

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def local_kafka_env(tmp_path_factory) -> dict[str, str] | None:
    """The environment under which `rtrl kafka up` started this session's broker (None when
    RTRL_KAFKA_BOOTSTRAP points at an existing one)."""
    if os.environ.get("RTRL_KAFKA_BOOTSTRAP"):
        yield None
        return
    from click.testing import CliRunner

    from pipeline.cli import cli

    env = {
        "RTRL_STATE_DIR": str(tmp_path_factory.mktemp("kafka-state")),
        "RTRL_KAFKA__PORT": str(free_port()),
        "RTRL_KAFKA__CONTROLLER_PORT": str(free_port()),
    }
    up = CliRunner().invoke(cli, ["kafka", "up"], env=env)
    assert up.exit_code == 0, up.output
    try:
        yield env
    finally:
        CliRunner().invoke(cli, ["kafka", "down"], env=env)


@pytest.fixture(scope="session")
def kafka_bootstrap(local_kafka_env) -> str:
    if local_kafka_env is None:
        return os.environ["RTRL_KAFKA_BOOTSTRAP"]
    return f"127.0.0.1:{local_kafka_env['RTRL_KAFKA__PORT']}"


def _postgres_database():
    admin_url = os.environ.get("RTRL_TEST_POSTGRES")
    if not admin_url:
        if IN_CI:
            pytest.fail("RTRL_TEST_POSTGRES is unset in CI: .ci/run must start PostgreSQL")
        pytest.skip("PostgreSQL tests need RTRL_TEST_POSTGRES (set by `make test` when PostgreSQL is available)")
    return scratch_database(admin_url, f"rtrl_t_{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_db_url(request, tmp_path) -> str:
    """A URL of an empty database, on each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'rtrl.db'}"
        return
    url, drop = _postgres_database()
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def db_url(empty_db_url) -> str:
    """A migrated database on each backend."""
    store_db.upgrade(empty_db_url)
    return empty_db_url


@pytest.fixture
def engine(db_url):
    eng = store_db.make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def topics(kafka_bootstrap) -> dict[str, str]:
    """Fresh interaction and feedback topics (3 partitions each) for one test."""
    from pipeline.kafka_local import ensure_topics

    suffix = uuid.uuid4().hex[:8]
    names = {"interactions": f"t-{suffix}.interactions", "feedback": f"t-{suffix}.feedback"}
    ensure_topics(kafka_bootstrap, list(names.values()), partitions=3)
    return names


@pytest.fixture
def cfg_env(tmp_path, db_url, kafka_bootstrap, topics) -> dict[str, str]:
    """RTRL_* variables that point a subprocess (or load_config) at this test's store and topics."""
    return {
        "RTRL_STATE_DIR": str(tmp_path / "state"),
        "RTRL_DB_URL": db_url,
        "RTRL_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "RTRL_KAFKA__INTERACTIONS_TOPIC": topics["interactions"],
        "RTRL_KAFKA__FEEDBACK_TOPIC": topics["feedback"],
        "RTRL_INGEST__GROUP_ID": f"g-{uuid.uuid4().hex[:8]}",
        "RTRL_INGEST__SESSION_TIMEOUT_MS": "6000",
    }


@pytest.fixture
def cfg(cfg_env) -> Config:
    return load_config(environ=cfg_env)


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def reverse_base(tmp_path_factory) -> Path:
    """The base policy of the reverse-a-string task (tests/reverse_task.py), built once."""
    from tests import reverse_task

    return reverse_task.make_base(tmp_path_factory.mktemp("reverse-base"))


@pytest.fixture(scope="session")
def bpe_base(tmp_path_factory) -> Path:
    """A Qwen2-architecture model with a 32,768-token byte-level BPE and a ChatML/tool-call chat
    template (`rtrl model init-tiny --tokenizer bpe`), random weights, built once."""
    from train.models import init_tiny

    return init_tiny(tmp_path_factory.mktemp("bpe-base") / "model", arch="qwen2", tokenizer="bpe", vocab=32_768)


class ServeProcess:
    """`rtrl serve --base-model BASE` in a process of its own on a free port, configured by `env`,
    its output in `log_path`; `stop()` ends it."""

    def __init__(self, base: Path, env: dict[str, str], log_path: Path) -> None:
        port, self.log_path = free_port(), log_path
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "serve", "--port", str(port), "--base-model", str(base)],
                env=env,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.url = f"http://127.0.0.1:{port}"

    def health(self) -> dict | None:
        """/health's answer; None while starting (a server that exited fails with its log's end)."""
        import requests

        try:
            return requests.get(f"{self.url}/health", timeout=2).json()
        except (requests.ConnectionError, requests.Timeout):  # a server still loading may accept, then not answer
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            return None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it returns something true (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)  # polling with a deadline, not synchronisation by sleep
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class InProcessServer:
    """An ASGI app served by uvicorn on a free port in a thread of this process (a real socket:
    what a client that disconnects, or a proxy in front, needs); `.url`, `.stop()`."""

    def __init__(self, app) -> None:
        import threading

        import uvicorn

        self.port = free_port()
        self.uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.uv.started, 30, "the server to start")
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.uv.should_exit = True
        self.thread.join(timeout=30)
