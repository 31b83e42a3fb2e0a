"""MLflow's client, imported with rtrl's defaults for its HTTP calls.

The MLflow client retries an unreachable tracking server for minutes by default; an operator at
a prompt, or a cycle that must record its outcome, wants the error now. The defaults are set
before mlflow is imported (it reads them then) and stay overridable from the environment.
"""

from __future__ import annotations

import os

os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")

from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

__all__ = ["MlflowClient", "MlflowException"]
