"""Model-update events: every alias move is announced on Kafka, keyed by model name, so that
every serving replica (and anything else) follows the registry without polling it.

    {"type": "model_update", "name": ..., "version": ..., "alias": "champion",
     "adapter_uri": "runs:/<run>/adapter", "base_model": ..., "run_id": ..., "at": ...}
"""

from __future__ import annotations

import json
from typing import Any

from kafka import KafkaProducer


class ModelUpdatePublisher:
    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic
        self.producer: KafkaProducer | None = None  # connected on first use: a registry command
        # that moves nothing never needs the broker

    def __call__(self, event: dict[str, Any]) -> None:
        if self.producer is None:
            # acks=all and a blocking send: the caller records "published" only once the broker has it
            self.producer = KafkaProducer(bootstrap_servers=self.bootstrap, acks="all", retries=5,
                                          request_timeout_ms=15_000, max_block_ms=15_000)
        self.producer.send(self.topic, key=event["name"].encode(), value=json.dumps(event).encode()).get(timeout=30)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
