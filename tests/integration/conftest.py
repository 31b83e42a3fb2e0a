"""The integration layer's fixtures: one real Kafka broker per session (per worker when the
suite runs in parallel), fresh topics per test, and a `cfg` that points at both.

- Kafka: `RTRL_KAFKA_BOOTSTRAP` when set, else a broker started through `pipeline.kafka_local`
  (the same code as `rtrl kafka up`) on free ports under a temporary state folder; it is
  stopped when the session ends.
"""

from __future__ import annotations

import os
import uuid

import pytest

from pipeline.core.config import Config, load_config
from tests.support.helpers import free_port


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


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(items):
    """Every test that reaches the session's broker is marked `kafka`, and every PostgreSQL case
    `postgres`, whether or not its module says so: `-m "not kafka"` leaves out exactly those."""
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "kafka_bootstrap" in names or "local_kafka_env" in names:
            item.add_marker(pytest.mark.kafka)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("empty_db_url") == "postgresql":
            item.add_marker(pytest.mark.postgres)
