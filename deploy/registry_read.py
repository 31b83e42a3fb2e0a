"""Reading the MLflow Model Registry: versions, aliases and their adapters (downloaded once
into a cache folder). deploy/registry.py's Registry adds every write (register, decisions,
alias moves, repair) on top; this part needs no store.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from deploy.mlflow_client import MlflowClient, MlflowException
from pipeline.core.logs import mask_uri, redacted_uri

CANDIDATE, CHAMPION, PREVIOUS, CANARY = "candidate", "champion", "previous", "canary"


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def _connection_failed(exc: MlflowException) -> bool:
    """MLflow's REST client reports a server it cannot reach as an MlflowException whose message
    wraps the connection error (after its retries)."""
    return "failed with exception" in exc.message and any(
        s in exc.message for s in ("Max retries exceeded", "Connection refused", "ConnectionError", "timed out")
    )


class RegistryError(RuntimeError):
    """The registry refused or could not be reached; the message says what to do."""


@dataclass
class Version:
    version: str
    run_id: str | None
    source: str
    tags: dict[str, str]
    aliases: list[str]


class RegistryReader:
    def __init__(
        self,
        tracking_uri: str,
        model_name: str,
        engine: Engine | None,
        publish: Callable[[dict[str, Any]], None] | None = None,
        cache_dir: Path | None = None,
    ) -> None:
        """`engine` (the store, for decisions and the audit trail) may be None for read-only use;
        `cache_dir` keeps downloaded adapters (see `adapter`)."""
        mask_uri(tracking_uri)  # MLflow's errors quote the URI: its password stays out of the logs
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.uri, self.name, self.engine, self.publish = tracking_uri, model_name, engine, publish
        self.shown = redacted_uri(tracking_uri)  # the URI in messages
        self.cache_dir = cache_dir
        # a daemon's cycle sets its lease's fence: its decisions and moves are then recorded only
        # while it holds the lease (the registry call follows the fenced audit row)
        self.fence: Any = None

    # --- reading -------------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except MlflowException as exc:
            if not _connection_failed(exc):
                raise RegistryError(f"registry {self.shown}: {what} failed: {self._hide(exc.message)}") from None
            raise self._unreachable(what, exc) from None
        except Exception as exc:  # noqa: BLE001 - connection errors come from requests/urllib3
            raise self._unreachable(what, exc) from None

    def _hide(self, message: str) -> str:
        """MLflow's message with the tracking URI (and so its password) as it is shown."""
        return message.replace(self.uri, self.shown)

    def _unreachable(self, what: str, exc: Exception) -> RegistryError:
        return RegistryError(
            f"registry {self.shown} unreachable during {what}: {type(exc).__name__}: {self._hide(str(exc))}. "
            "Check mlflow.tracking_uri and that the server is up; nothing was moved"
        )

    def _version(self, mv: Any) -> Version:
        return Version(str(mv.version), mv.run_id, mv.source, dict(mv.tags or {}), list(mv.aliases or []))

    def get(self, version: str) -> Version:
        try:
            return self._version(self.client.get_model_version(self.name, str(version)))
        except MlflowException:
            known = ", ".join(v.version for v in self.list()) or "none"
            raise RegistryError(f"model {self.name} has no version {version} (versions: {known})") from None

    def alias(self, alias: str) -> Version | None:
        try:
            return self._version(self.client.get_model_version_by_alias(self.name, alias))
        except MlflowException as exc:
            if _connection_failed(exc):
                raise self._unreachable(f"reading alias {alias}", exc) from None
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                return None
            raise RegistryError(f"registry {self.shown}: reading alias {alias} failed: {exc.message}") from None
        except Exception as exc:  # noqa: BLE001
            raise self._unreachable(f"reading alias {alias}", exc) from None

    def list(self) -> list[Version]:
        found = self._call("listing versions", lambda: self.client.search_model_versions(f"name='{self.name}'"))
        if not found:
            return []
        # search results do not carry aliases; the registered model does (alias -> version)
        aliases = self._call("reading aliases", lambda: self.client.get_registered_model(self.name).aliases) or {}
        out = []
        for mv in found:
            v = self._version(mv)
            v.aliases = sorted(a for a, ver in aliases.items() if str(ver) == v.version)
            out.append(v)
        return sorted(out, key=lambda v: int(v.version))

    def download(self, version: Version | str, dst: Path) -> Path:
        """An adapter directory (a version's source, or an artifact URI), downloaded under `dst`."""
        from mlflow.artifacts import download_artifacts

        uri = version.source if isinstance(version, Version) else version
        path = self._call(
            f"downloading {uri}", lambda: download_artifacts(artifact_uri=uri, dst_path=str(dst), tracking_uri=self.uri)
        )
        return Path(path)

    def adapter(self, version: Version, tmp: Path) -> Path:
        """The version's adapter directory. A version's source never changes, so with a cache
        folder each one is downloaded once (the daemon needs the champion twice a cycle: as the
        parent to train from and as the policy to beat); without one, into `tmp`."""
        if self.cache_dir is None:
            return self.download(version, tmp)
        key = hashlib.sha256(f"{self.uri}\n{version.source}".encode()).hexdigest()[:16]
        final = self.cache_dir / f"{_safe(self.name)}-v{version.version}-{key}"
        if not final.is_dir():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=self.cache_dir, prefix=".download-") as part:
                got = self.download(version, Path(part))
                try:
                    os.replace(got, final)  # atomic: a crash never leaves half an adapter under the final name
                except OSError:
                    if not final.is_dir():  # not another process finishing the same download first
                        raise
        return final

    def version_of_run(self, run_id: str) -> Version | None:
        """The version already registered for training run `run_id` (its `rtrl.run_id` tag)."""
        found = [v for v in self.list() if v.tags.get("rtrl.run_id") == run_id]
        return found[0] if found else None
