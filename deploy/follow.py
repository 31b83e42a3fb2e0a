"""Following the registry: read model-update events from Kafka and act on each move of the
aliases a follower asks for (the champion; the reference server also follows the canary).

Used by the reference server (deploy/serve.py: load the new adapter, swap) and by the vLLM hook
(deploy/vllm.py: load it on a vLLM server under a versioned name, unload the old one). The
follower seeks to the end of the topic *before* the caller reads the current champion from the
registry, so a move that happens in between is still seen (acting on it twice is harmless).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from kafka import KafkaConsumer, TopicPartition

log = logging.getLogger("rtrl.deploy")


class Follower:
    def __init__(self, bootstrap: str, topic: str, model_name: str,
                 on_update: Callable[[dict[str, Any]], None], aliases: tuple[str, ...] = ("champion",)) -> None:
        self.model_name, self.on_update, self.aliases = model_name, on_update, aliases
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                      consumer_timeout_ms=500)
        partitions = self.consumer.partitions_for_topic(topic) or {0}
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        for tp in tps:
            self.consumer.position(tp)  # resolve "end" now, not lazily at the first poll
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="model-updates", daemon=True)

    def start(self) -> "Follower":
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.is_set():
            for records in self.consumer.poll(timeout_ms=500).values():
                for record in records:
                    self._handle(record.value)
        self.consumer.close()

    def _handle(self, raw: bytes) -> None:
        try:
            event = json.loads(raw)
        except ValueError:
            log.error("unreadable model-update event ignored", extra={"raw": raw[:200].decode(errors="replace")})
            return
        if event.get("name") != self.model_name or event.get("alias") not in self.aliases:
            return
        try:
            self.on_update(event)
        except Exception as exc:  # noqa: BLE001 - a bad adapter must not stop following
            log.error("model update not applied; still serving the previous version",
                      extra={"version": event.get("version"), "error": f"{type(exc).__name__}: {exc}"})

    def close(self) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
