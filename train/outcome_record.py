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
    """The manifest of the newest fit (None: none yet). A pointer or manifest that cannot be read
    is a ValueError that names the file (what reads it reports it; a cycle fits a new one)."""
    pointer = state_dir / "outcome" / LATEST
    if not pointer.is_file():
        return None
    try:
        path = Path(json.loads(pointer.read_text())["path"])
        return json.loads((path / MANIFEST).read_text()) if (path / MANIFEST).is_file() else None
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ValueError(
            f"cannot read the outcome model's record under {pointer.parent}: {type(exc).__name__}: "
            f"{exc} (the next fit replaces it: `rtrl reward model fit`)"
        ) from None


def gate_use(usable: bool, estimator: str, fresh_prompts: int, fallback: str) -> str:
    """What the gate does with a model of this usability under these gate settings."""
    if estimator == "importance":
        return "recorded only: gate.estimator = importance decides"
    if not fresh_prompts:
        return f"not used: gate.fresh_prompts = 0, so the gate {_without(fallback)}"
    return f"decides ({estimator})" if usable else f"NOT USED: the gate {_without(fallback)}"


def _without(fallback: str) -> str:
    return "falls back to importance sampling" if fallback == "importance" else "refuses (gate.fallback = refuse)"


def point_at(state_dir: Path, path: Path) -> None:
    """Make the fit in `path` the newest (written after the fit is whole: a crash leaves the last one)."""
    (state_dir / "outcome" / LATEST).write_text(json.dumps({"path": str(path)}))
