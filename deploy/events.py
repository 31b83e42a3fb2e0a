"""Events rtrl puts on Kafka itself, through one kind of producer (EventSender): keyed, and
blocking until the broker has the event (acks=all), so a caller records only what is durable.

    model updates   every alias move is announced, keyed by model name, so that every serving
                    replica (and anything else) follows the registry without polling it
                    (pipeline.core.types.ModelUpdate)
    interactions    what `rtrl serve` answered, keyed by request id
    feedback        what the simulated users did (pipeline/demo/sim.py), keyed by request id
"""

from __future__ import annotations

import json
from typing import Any

from kafka import KafkaProducer

from pipeline.core import kafka_client
from pipeline.core.kafka_config import KafkaAccess


class EventSender:
    def __init__(self, access: KafkaAccess | str, topic: str, key: str, timeout_s: float = 15.0) -> None:
        """`access`: the brokers and their security (a bare "host:port": plaintext); `key`: the
        event field that keys the record (its partition); `timeout_s`: how long a send may wait
        for the broker (connecting, and each request)."""
        self.access, self.topic, self.key, self.timeout_s = KafkaAccess.of(access), topic, key, timeout_s
        self.producer: KafkaProducer | None = None  # connected on first use: a registry command
        # that moves nothing never needs the broker

    def __call__(self, event: dict[str, Any]) -> None:
        if self.producer is None:
            ms = int(self.timeout_s * 1000)
            self.producer = kafka_client.producer(self.access, acks="all", retries=5,
                                                  request_timeout_ms=ms, max_block_ms=ms, bootstrap_timeout_ms=ms)
        self.producer.send(self.topic, key=str(event[self.key]).encode(),
                           value=json.dumps(event).encode()).get(timeout=2 * self.timeout_s)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()


class ModelUpdatePublisher(EventSender):
    def __init__(self, access: KafkaAccess | str, topic: str) -> None:
        super().__init__(access, topic, key="name")
