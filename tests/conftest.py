"""Fixtures of both layers: stores on SQLite and PostgreSQL, the tiny base models, and a `cfg`
without a broker (tests/integration/conftest.py gives the integration layer one with a broker).

- Layers: tests/unit/ needs no broker, no PostgreSQL and no process of its own (`make test-unit`);
  tests/integration/ is everything else. Helpers both use live in tests/support/.
- PostgreSQL: `RTRL_TEST_POSTGRES` is a URL of a database whose role may CREATE DATABASE;
  each test gets a fresh database. Outside CI the PostgreSQL cases skip when it is unset; in
  CI (CI=true) they fail instead, so a missing PostgreSQL can never pass silently.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

from pipeline.core.config import Config, load_config
from pipeline.core.store import db as store_db
from tests.support.scratch_db import scratch_database

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


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
def cfg_env(tmp_path, db_url) -> dict[str, str]:
    """RTRL_* variables that point a subprocess (or load_config) at this test's store and state
    folder. No broker: kafka.bootstrap names a port nothing listens on, so a test that reaches for
    Kafka by mistake fails at once (tests/integration/conftest.py adds a real broker and topics)."""
    return {
        "RTRL_STATE_DIR": str(tmp_path / "state"),
        "RTRL_DB_URL": db_url,
        "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1",
        "RTRL_KAFKA__CONNECT_TIMEOUT_S": "1",
    }


@pytest.fixture
def cfg(cfg_env) -> Config:
    return load_config(environ=cfg_env)


@pytest.fixture(scope="session")
def reverse_base(tmp_path_factory) -> Path:
    """The base policy of the reverse-a-string task (tests/support/reverse_task.py), built once."""
    from tests.support import reverse_task

    return reverse_task.make_base(tmp_path_factory.mktemp("reverse-base"))


@pytest.fixture(scope="session")
def bpe_base(tmp_path_factory) -> Path:
    """A Qwen2-architecture model with a 32,768-token byte-level BPE and a ChatML/tool-call chat
    template (`rtrl model init-tiny --tokenizer bpe`), random weights, built once."""
    from train.models import init_tiny

    return init_tiny(tmp_path_factory.mktemp("bpe-base") / "model", arch="qwen2", tokenizer="bpe", vocab=32_768)


@pytest.fixture(scope="module")
def real(reverse_base):
    """The reverse task's base as `rtrl serve` loads it (a PolicySet on the CPU)."""
    from train.inference import PolicySet

    return PolicySet.load(reverse_base, device="cpu")


# The longest modules (by the suite's --durations on two cores), run first: `make test` hands
# whole modules to its two processes in collection order, so one long module left for last
# keeps a process busy while the other has finished. Order only: a module missing here, or a
# renamed one, simply runs in its usual place.
LONGEST_FIRST = (
    "test_daemon_crash.py",
    "test_ingest_kafka.py",
    "test_distributed.py",
    "test_real_model.py",
    "test_demo.py",
    "test_reward_incremental.py",
    "test_deploy_registry.py",
    "test_kafka_security.py",
)


@pytest.hookimpl(trylast=True)  # after the layers' own hooks (markers) and any deselection
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in-module order kept
