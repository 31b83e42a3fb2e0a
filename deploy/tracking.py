"""MLflow tracking for training runs (train.tracking.Tracker, implemented with mlflow).

deploy is the one package that imports mlflow; the training stage only sees the protocol.
It uses an explicit MlflowClient, never the fluent API's process-global "active run": the
daemon runs cycles in one long-lived process and must not leak a run from one into the next.

Embedded default: a SQLite tracking store in the state folder with artifacts beside it; a
tracking server URL when `mlflow.tracking_uri` is set.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus, RunTag

from deploy.mlflow_client import MlflowClient
from pipeline.core.logs import mask_uri

MAX_PARAM_CHARS = 6000  # MLflow's limit on a parameter value
BATCH = 100  # MLflow's limit on params per log_batch call
METRICS_PER_CALL = 1000  # ...and on metrics
FLUSH_S = 10.0  # metrics reach the store at least this often during a run


class MlflowTracker:
    def __init__(
        self, tracking_uri: str, experiment: str, artifact_root: Path | None = None, run_name: str | None = None
    ) -> None:
        mask_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            experiment_id = found.experiment_id
        else:
            # a file-backed store needs an explicit artifact root, else artifacts land in ./mlruns
            location = artifact_root.resolve().as_uri() if artifact_root and _is_local(tracking_uri) else None
            experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self.run_id: str | None = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self._buffer: list[Metric] = []
        self._flushed = time.monotonic()

    def log_params(self, params: dict[str, Any]) -> None:
        items = [Param(k, str(v)[:MAX_PARAM_CHARS]) for k, v in sorted(params.items())]
        for i in range(0, len(items), BATCH):
            self.client.log_batch(self.run_id, params=items[i : i + BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Buffered: a store round trip per step would stall a fast loop. Written every
        FLUSH_S seconds or METRICS_PER_CALL metrics, and by end()."""
        now = int(time.time() * 1000)
        self._buffer += [Metric(k, float(v), now, step) for k, v in metrics.items()]
        if len(self._buffer) >= METRICS_PER_CALL or time.monotonic() - self._flushed > FLUSH_S:
            self.flush()

    def flush(self) -> None:
        while self._buffer:
            batch, self._buffer = self._buffer[:METRICS_PER_CALL], self._buffer[METRICS_PER_CALL:]
            self.client.log_batch(self.run_id, metrics=batch)
        self._flushed = time.monotonic()

    def log_artifacts(self, local_dir: Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def set_tags(self, tags: dict[str, str]) -> None:
        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), BATCH):  # one store round trip per hundred, not one per tag
            self.client.log_batch(self.run_id, tags=items[i : i + BATCH])

    def end(self, status: str) -> None:
        self.flush()
        self.client.set_terminated(self.run_id, status=RunStatus.to_string(RunStatus.from_string(status)))


def _is_local(uri: str) -> bool:
    return uri.startswith(("sqlite:", "file:")) or "://" not in uri
