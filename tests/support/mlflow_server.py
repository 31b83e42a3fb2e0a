"""A real `mlflow server` process for tests (tracking + registry + artifact proxy) on 127.0.0.1:
started on a port, killed (the whole process group, as a crash would), restarted on the same
stores."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import requests

from tests.support.helpers import wait_for


def start(root: Path, port: int, timeout_s: float = 120.0) -> subprocess.Popen:
    """The server on `port`, its backend store and artifacts under `root`; returns once /health answers."""
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--backend-store-uri",
            f"sqlite:///{root / 'mlflow.db'}",
            "--artifacts-destination",
            str(root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
        ],
        stdout=open(root / "log.txt", "ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        # MLflow 3's job runner: half a dozen huey consumers per server (~250 MB and an mlflow
        # import each), in sessions of their own that a kill of the server's group leaves
        # running. The registry needs none of it
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )

    def healthy() -> bool:
        assert proc.poll() is None, (root / "log.txt").read_text()[-3000:]
        try:
            return requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
        except requests.RequestException:  # not listening yet, or listening and not answering yet
            return False

    try:
        wait_for(healthy, timeout_s, "the mlflow server to start", interval=0.5)
    except BaseException:  # a server that never came up is not left behind
        kill(proc)
        raise
    return proc


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the server and its workers: the registry is gone, mid-request if need be."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        kill(proc)
