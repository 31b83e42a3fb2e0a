"""Every script under benchmarks/ runs at a tiny size (seconds each, no timing asserted), so that
a schema or API change that breaks one fails here rather than the next time someone measures."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.helpers import REPO


def bench(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-3000:])
    return done.stdout


def test_reward():
    assert "episodes/s" in bench("benchmarks/reward.py", "--sizes", "300", "--workers", "1", "--repeat", "1")


def test_train():
    out = bench(
        "benchmarks/train.py",
        "--steps",
        "2",
        "--repeats",
        "1",
        "--hidden",
        "32",
        "--layers",
        "1",
        "--prompt",
        "8",
        "--completion",
        "8",
        "--batch",
        "4",
        "--variants",
        "rtrl",
    )
    assert "tokens/s" in out


def test_gate_memory():
    assert '"kl"' in bench("benchmarks/gate_memory.py", "--episodes", "2", "--vocab", "1000", "--completion", "4")


def test_gateway():
    out = bench("benchmarks/gateway.py", "--concurrency", "2", "--seconds", "0.3")
    assert out.count("/") >= 2 and "events" in out


@pytest.mark.kafka
def test_ingest(kafka_bootstrap):
    out = bench(
        "benchmarks/ingest.py", "--events", "400", "--naive-events", "50", "--bootstrap", kafka_bootstrap, "--group"
    )
    assert "(d) naive" in out and "fast path" in out
    if os.environ.get("RTRL_TEST_POSTGRES"):
        assert "(e) 2 ingest processes" in out


def test_cycle_queries():
    out = bench("benchmarks/cycle_queries.py", "--sizes", "200", "400", "--repeat", "1")
    assert "served and accepted" in out and "ratio" in out


def test_store_costs():
    out = bench(
        "benchmarks/store_costs.py",
        "--events",
        "200",
        "--repeat",
        "1",
        "--revision",
        "0011",
        "--completion-chars",
        "300",
    )
    assert "without ix_feedback_request_id" in out and "without ix_interactions_ts" in out
    assert "without output_text (300 chars)" in out


def test_the_gpu_check_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "gpu_check.sh")]).returncode == 0


def test_decisions():
    out = bench("benchmarks/decisions.py", "--runs", "20", "--max-requests", "200")
    assert "| A/A copy | +0.0000 |" in out and "fixed-size test's" in out
    assert "gate, then canary, promote" in out and "the whole decision (gate, then canary) promotes: A/A copies" in out
