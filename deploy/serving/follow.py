"""Following the registry: read model-update events from Kafka and act on each move of the
aliases a follower asks for (the champion; the reference server also follows the canary).

An event is only a wake-up. What to serve is read from the registry (`current`), never taken
from the event: anyone who can write to the topic could otherwise make serving load any
adapter, ungated, and an event delivered late (a repair after an outage, a replayed topic)
would switch serving back to an older state. A registry that cannot be read when an event
arrives is read again every `retry_s` until it answers, and an update the caller fails to apply
(vLLM refused the load, the download broke) is tried again, backing off to once a minute.
Versions must be plain registry ids (digits): a version becomes a path component of the adapter's download folder.

Used by the reference server (deploy/serving/serve.py: load the new adapter, swap) and by the vLLM hook
(deploy/serving/vllm.py: load it on a vLLM server under a versioned name, unload the old one). The
follower seeks to the end of the topic *before* the caller reads the current champion from the
registry, so a move that happens in between is still seen (acting on it twice is harmless).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition

from pipeline.core import kafka_client
from pipeline.core.kafka_config import KafkaAccess
from pipeline.core.types import ModelUpdate

log = logging.getLogger("rtrl.deploy")
_VERSION_ID = re.compile(r"[0-9]{1,18}")


def current(registry: Any, alias: str) -> ModelUpdate:
    """What serving should do for `alias` now, read from the registry (version None: cleared;
    a canary's share is tagged on its version)."""
    v = registry.alias(alias)
    if v is None:
        return ModelUpdate(alias, None, name=registry.name)
    if not _VERSION_ID.fullmatch(v.version):
        raise ValueError(f"registry version {v.version!r} of {alias} is not a plain version id; not served")
    share = float(v.tags.get("rollout.share", 0.0)) if alias == "canary" else 0.0
    return ModelUpdate(
        alias,
        v.version,
        v.source,
        share=share,
        name=registry.name,
        base_model=v.tags.get("base_model"),
        run_id=v.run_id,
    )


class Follower:
    def __init__(
        self,
        access: KafkaAccess | str,
        topic: str,
        model_name: str,
        on_update: Callable[[ModelUpdate], None],
        resolve: Callable[[str], ModelUpdate],
        aliases: tuple[str, ...] = ("champion",),
        retry_s: float = 5.0,
    ) -> None:
        """`resolve(alias)`: the registry's state of an alias (`current` with a registry)."""
        self.model_name, self.on_update, self.resolve, self.aliases = model_name, on_update, resolve, aliases
        self.retry_s, self.stale = retry_s, set()  # aliases to read again
        self.next_try: dict[str, float] = {}  # an alias's next try after a failure
        self.failures: dict[str, int] = {}  # an alias's failures in a row (its backoff's exponent)
        self.consumer = kafka_client.consumer(access, group_id=None, enable_auto_commit=False, consumer_timeout_ms=500)
        partitions = self.consumer.partitions_for_topic(topic) or {0}
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        for tp in tps:
            self.consumer.position(tp)  # resolve "end" now, not lazily at the first poll
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="model-updates", daemon=True)

    def start(self) -> Follower:
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            for records in self.consumer.poll(timeout_ms=500).values():
                for record in records:
                    self._handle(record.value)
            if self.stale:
                self._apply()
        self.consumer.close()

    def _handle(self, raw: bytes) -> None:
        try:
            event = ModelUpdate.from_json(raw)
        except ValueError as exc:  # json's decode error is one too
            log.error(
                "unreadable model-update event ignored",
                extra={"raw": raw[:200].decode(errors="replace"), "error": str(exc)},
            )
            return
        if event.name != self.model_name or event.alias not in self.aliases:
            return
        self.stale.add(event.alias)
        self.next_try.pop(event.alias, None)  # a new move: tried at once
        self._apply()

    def _apply(self) -> None:
        """Read each stale alias from the registry and act on it, the champion first; what fails
        is tried again after its own backoff (retry_s, doubling to 60 s), and never holds up the
        other alias: a canary vLLM can never load must not keep the champion from moving."""
        now = time.monotonic()
        for alias in sorted(self.stale, key=lambda a: a != "champion"):
            if now < self.next_try.get(alias, 0.0):
                continue
            try:
                update = self.resolve(alias)
            except Exception as exc:  # noqa: BLE001 - registry away: read again in retry_s
                self._back_off(alias, "registry not read after a model-update event; trying again", None, exc)
                continue
            try:
                self.on_update(update)
            except Exception as exc:  # noqa: BLE001 - a bad adapter must not stop following
                # a load that failed once (vLLM busy, a download cut) must not leave serving on
                # the previous version until the next move
                self._back_off(
                    alias,
                    "model update not applied; still serving the previous version, trying again",
                    update.version,
                    exc,
                )
                continue
            self.stale.discard(alias)
            self.failures.pop(alias, None)
            self.next_try.pop(alias, None)

    def _back_off(self, alias: str, message: str, version: str | None, exc: Exception) -> None:
        self.failures[alias] = min(self.failures.get(alias, 0) + 1, 6)
        wait = min(self.retry_s * 2 ** (self.failures[alias] - 1), 60.0)
        self.next_try[alias] = time.monotonic() + wait
        log.error(
            message,
            extra={
                "alias": alias,
                "version": version,
                "retry_in_s": round(wait, 1),
                "error": f"{type(exc).__name__}: {exc}",
            },
        )

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
