"""What many tests share: the repository's root, a free local port, polling with a deadline."""

from __future__ import annotations

import socket
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    """Poll `predicate` until it returns something true (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)  # polling with a deadline, not synchronisation by sleep
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
