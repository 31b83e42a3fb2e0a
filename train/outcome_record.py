"""Where outcome models are kept, read without loading one (no torch): `rtrl status` and
`rtrl reward model show` read the newest fit's manifest.

    <state>/outcome/<id>/outcome.json   one fit: window, slices, figures, usable or not and why
    <state>/outcome/latest.json         {"path": the newest fit's folder}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MANIFEST = "outcome.json"
LATEST = "latest.json"


def latest(state_dir: Path) -> dict[str, Any] | None:
    """The manifest of the newest fit (None: none yet)."""
    pointer = state_dir / "outcome" / LATEST
    if not pointer.is_file():
        return None
    path = Path(json.loads(pointer.read_text())["path"])
    return json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else None


def point_at(state_dir: Path, path: Path) -> None:
    """Make the fit in `path` the newest (written after the fit is whole: a crash leaves the last one)."""
    (state_dir / "outcome" / LATEST).write_text(json.dumps({"path": str(path)}))
