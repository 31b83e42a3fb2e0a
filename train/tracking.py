"""What a training run reports to, without importing a tracking library.

The training stage describes its run through this protocol; the orchestration layer passes
the MLflow implementation (deploy.tracking, the one module that imports mlflow), tests and
`--dry-run` pass a MemoryTracker.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    run_id: str | None

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None: ...

    def set_tags(self, tags: dict[str, str]) -> None: ...

    def end(self, status: str) -> None: ...


class MemoryTracker:
    """Keeps everything in memory: for tests and runs that must not be recorded."""

    def __init__(self) -> None:
        self.run_id: str | None = None
        self.params: dict[str, Any] = {}
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.artifacts: dict[str, Path] = {}
        self.tags: dict[str, str] = {}
        self.status: str | None = None

    def log_params(self, params: dict[str, Any]) -> None:
        self.params.update(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        self.artifacts[artifact_path] = Path(local_dir)

    def set_tags(self, tags: dict[str, str]) -> None:
        self.tags.update(tags)

    def end(self, status: str) -> None:
        self.status = status
