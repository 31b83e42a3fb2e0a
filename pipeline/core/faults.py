"""Named points where a crash test freezes the process so that it can kill it there (kill -9).

    RTRL_FAULT_PAUSE=promote.champion_moved RTRL_FAULT_MARKER=/tmp/marker rtrl daemon

At the named point the process writes the marker file and blocks forever (for
RTRL_FAULT_PAUSE_S seconds when set); the test sees the file and sends SIGKILL (or SIGSTOP) from
outside -- a crash at an exact instant, without racing a polling loop against a step that lasts
milliseconds. Unset (always, outside tests) a point costs one
environment lookup. The points:

    train.step               after an optimizer step of the training loop
    promote.champion_moved   the registry's `champion` alias moved, its audit row still pending
    canary.decided           a canary's online decision recorded, the canary not yet promoted
                             or withdrawn
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

POINTS = ("train.step", "promote.champion_moved", "canary.decided")


def pause_point(name: str) -> None:
    """Block here if RTRL_FAULT_PAUSE names this point (after writing RTRL_FAULT_MARKER): forever,
    or RTRL_FAULT_PAUSE_S seconds."""
    if os.environ.get("RTRL_FAULT_PAUSE") != name:
        return
    marker = os.environ.get("RTRL_FAULT_MARKER")
    if marker:
        Path(marker).write_text(f"{name} {os.getpid()}\n")
    seconds = os.environ.get("RTRL_FAULT_PAUSE_S")
    threading.Event().wait(float(seconds) if seconds else None)
