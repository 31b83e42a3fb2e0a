"""The vLLM hook: keep a vLLM server on the champion adapter (and the canary's, if staged).

On each model-update event the new adapter is downloaded from the registry, loaded on the vLLM
server under a versioned name (`<model>-v<version>`, POST /v1/load_lora_adapter), and only then,
after a grace period longer than the gateway's poll, is the previous one unloaded (POST
/v1/unload_lora_adapter): clients asking for the new name find it, and the gateway has moved its
routes to it before the old name goes. A name vLLM lists already (GET /v1/models)
is not loaded again: a restarted sync picks up where vLLM is. A load that fails raises, and the
follower tries the update again with a backoff (deploy/serving/follow.py). vLLM must run with
VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, --enable-lora, --max-loras of at least 3 (the champion,
the canary and the one being loaded) and --max-lora-rank of at least train.lora_r; `rtrl gateway`
routes to a name only once /v1/models lists it (docs/operations.md, "vLLM").

Staged rollout: a canary's adapter is loaded the same way next to the champion's and unloaded
when the canary is withdrawn (kept when it is promoted). vLLM does not split traffic: the
router in front of it sends the canary's share (`share` in the event; the same request-id hash
as rtrl serve: deploy.serving.routing.routes_to_canary) to `<model>-v<canary>`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests

from pipeline.core.types import ModelUpdate

log = logging.getLogger("rtrl.deploy")


class VllmError(RuntimeError):
    """The vLLM server refused or could not be reached."""


class VllmAdapterSync:
    def __init__(
        self,
        base_url: str,
        model_name: str,
        fetch: Callable[[str, Path], Path],
        download_dir: Path,
        timeout_s: float = 60.0,
        grace_s: float = 10.0,
    ) -> None:
        """`grace_s`: how long an adapter no version needs any more stays loaded before it is
        unloaded -- longer than the gateway's --poll, so that it has moved its routes away first
        (requests routed to it meanwhile are answered, not refused with a 404)."""
        self.base_url, self.model_name, self.fetch = base_url.rstrip("/"), model_name, fetch
        self.download_dir, self.timeout_s, self.grace_s = download_dir, timeout_s, grace_s
        self.current: str | None = None  # the lora_name vLLM serves as champion
        self.canary: str | None = None  # the staged candidate's lora_name, if any
        self.kept: list[str] = []  # names whose unload was called off: needed again within the grace period
        self.timers: list[threading.Timer] = []  # the grace periods running
        self.lock = threading.Lock()

    def _post(self, path: str, body: dict[str, Any]) -> None:
        try:
            r = requests.post(f"{self.base_url}{path}", json=body, timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise VllmError(f"vLLM at {self.base_url} unreachable ({path}): {exc}") from None
        if r.status_code >= 400:
            raise VllmError(f"vLLM refused {path} for {body.get('lora_name')}: HTTP {r.status_code} {r.text[:300]}")

    def on_update(self, event: ModelUpdate) -> None:
        with self.lock:  # (a grace period's unload runs in a timer thread: it must see the names chosen)
            self._on_update(event)

    def _on_update(self, event: ModelUpdate) -> None:
        if event.alias == "canary":
            self._on_canary(event)
            return
        if event.version is None:  # no champion (the registry's alias cleared): nothing to load
            log.warning("the champion alias is cleared; vLLM keeps its adapters", extra={"lora_name": self.current})
            return
        name = f"{self.model_name}-v{event.version}"
        if name == self.current:
            return
        if name != self.canary:  # a promoted canary is loaded already
            self._load(name, event.adapter_uri)
        old, self.current = self.current, name
        if self.canary == name:
            self.canary = None
        log.info("vLLM serves a new adapter", extra={"lora_name": name, "previous": old})
        if old is not None and old != self.canary:
            self._unload(old)

    def _on_canary(self, event: ModelUpdate) -> None:
        name = f"{self.model_name}-v{event.version}" if event.version else None
        if name == self.canary:
            return
        if name is not None and name != self.current:
            self._load(name, event.adapter_uri)
        old, self.canary = self.canary, (name if name != self.current else None)
        log.info(
            "vLLM canary adapter " + ("loaded: route its share to it" if self.canary else "withdrawn"),
            extra={"lora_name": self.canary, "share": event.share, "previous": old},
        )
        if old is not None and old != self.current:
            self._unload(old)

    def served(self) -> set[str]:
        """The adapters vLLM lists now (GET /v1/models: loaded LoRAs have the base as `parent`)."""
        try:
            r = requests.get(f"{self.base_url}/v1/models", timeout=self.timeout_s)
            r.raise_for_status()
            return {m["id"] for m in r.json()["data"] if m.get("parent")}
        except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
            raise VllmError(f"vLLM at {self.base_url}: /v1/models not read: {exc}") from None

    def _load(self, name: str, adapter_uri: str) -> None:
        """Load `name` unless vLLM has it already (a restarted sync: vLLM refuses to load a loaded
        name with a 400, serving/lora's "has already been loaded")."""
        if name in self.served():
            log.info("vLLM has the adapter already", extra={"lora_name": name})
            return
        path = self.fetch(adapter_uri, self.download_dir / name)
        self._post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def _unload(self, name: str) -> None:
        """Unload `name` after the grace period, unless it is the champion or the canary again."""
        timer = threading.Timer(self.grace_s, self._unload_now, args=(name,))
        timer.daemon = True
        timer.start()
        self.timers = [t for t in self.timers if t.is_alive()] + [timer]

    def _unload_now(self, name: str) -> None:
        with self.lock:
            if name in (self.current, self.canary):
                self.kept.append(name)  # needed again (a rollback, a canary staged anew) within the grace period
                return
            self._unload_after_grace(name)

    def _unload_after_grace(self, name: str) -> None:
        try:
            self._post("/v1/unload_lora_adapter", {"lora_name": name})
        except VllmError as exc:  # the new one is live; a stale adapter only costs memory
            log.warning("old adapter not unloaded from vLLM", extra={"lora_name": name, "error": str(exc)})
