"""Servers a test talks to over a real socket: `rtrl serve` in a process of its own, or an ASGI app
served by uvicorn in a thread of the test's process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.helpers import REPO, free_port, wait_for


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
