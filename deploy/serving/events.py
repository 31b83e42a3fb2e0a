"""Events rtrl puts on Kafka itself, through one kind of producer (EventSender): keyed, and
blocking until the broker has the event (acks=all), so a caller records only what is durable --
or, given a spool (pipeline/core/spool.py), until the local spool has it while the broker is
away (rtrl serve's interaction events: an answer already given is never lost for the loop).

    model updates   every alias move is announced, keyed by model name, so that every serving
                    replica (and anything else) follows the registry without polling it
                    (pipeline.core.types.ModelUpdate)
    interactions    what `rtrl serve` answered, keyed by request id
    feedback        what the simulated users did (pipeline/demo/sim.py), keyed by request id
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from kafka import KafkaProducer
from kafka import errors as kerrors

from pipeline.core import kafka_client
from pipeline.core.kafka_config import KafkaAccess
from pipeline.core.spool import BatchRefused, Spool

log = logging.getLogger("rtrl.events")


FEEDBACK_KEY = ("request_id", "episode_id")  # a feedback event names one of them


class EventSender:
    def __init__(
        self,
        access: KafkaAccess | str,
        topic: str,
        key: str | tuple[str, ...],
        timeout_s: float = 15.0,
        spool: Spool | None = None,
        retry_s: float = 2.0,
        write_ahead: bool = False,
    ) -> None:
        """`access`: the brokers and their security (a bare "host:port": plaintext); `key`: the
        event field that keys the record (its partition), or fields of which the first one the
        event has keys it (feedback names a request or an episode); `timeout_s`: how long a send may wait
        for the broker (connecting, and each request). With a `spool`, an event the broker does
        not acknowledge is kept there (and every later one behind it, in order) and sent by a
        background thread once the broker is back, trying every `retry_s`; without, the send's
        error is the caller's. `write_ahead` (with a spool): every event goes to the spool first
        and the background thread sends it, in batches of in-flight records -- a call costs an
        append instead of a broker round trip, and a process killed at any moment loses nothing
        it was given (only a machine that goes down loses the spool's last group-commit
        interval): the gateway's way, which appends each answer's event before giving it."""
        self.access, self.topic, self.timeout_s = KafkaAccess.of(access), topic, timeout_s
        self.keys = (key,) if isinstance(key, str) else key
        self.producer: KafkaProducer | None = None  # connected on first use: a registry command
        # that moves nothing never needs the broker
        self.spool, self.retry_s, self.write_ahead = spool, retry_s, write_ahead and spool is not None
        self.wake, self.stopped = threading.Event(), threading.Event()
        self.failing = False  # the last drain failed: the broker is away
        self.refused: str | None = None  # the broker refuses this producer's login or rights: why
        self.one_by_one = False  # a batch was refused for good: the next drain finds the record at fault
        self.drainer = threading.Thread(target=self._drain_loop, name="spool-drain", daemon=True) if spool else None
        if self.drainer is not None:
            self.drainer.start()

    def __call__(self, event: dict[str, Any]) -> None:
        """Returns once the broker has the event -- or, with a spool, once the spool does
        (SpoolFull when it is full and refuses)."""
        key = next((str(event[k]).encode() for k in self.keys if event.get(k) is not None), None)
        value = json.dumps(event).encode()
        if self.spool is None:
            self._send(self.topic, key, value)
            return
        self.spool.check_owner()
        if self.refused is not None and not self.write_ahead:
            raise PermissionError(f"Kafka refuses this producer: {self.refused}")
        if not self.write_ahead and not self.spool.pending():  # (behind a spooled event, an event waits its turn)
            try:
                self._send(self.topic, key, value)
                return
            except kafka_client.REFUSALS as exc:  # wrong credentials or rights: said, not spooled
                self._reset()
                raise PermissionError(f"Kafka refuses this producer ({type(exc).__name__}): {exc}") from None
            except Exception as exc:  # noqa: BLE001 - kafka errors of every kind: spooled
                self._reset()
                log.warning(
                    "the broker did not take an event; spooling until it is back",
                    extra={"topic": self.topic, "spool": str(self.spool.dir), "error": f"{type(exc).__name__}: {exc}"},
                )
        self.spool.append(self.topic, key, value)
        self.wake.set()

    def _send(self, topic: str, key: bytes | None, value: bytes) -> None:
        self._in_flight(topic, key, value).get()

    def _in_flight(self, topic: str, key: bytes | None, value: bytes) -> _Ack:
        """The record sent, not yet acknowledged: `.get()` waits for the broker's ack."""
        if self.producer is None:
            ms = int(self.timeout_s * 1000)
            self.producer = kafka_client.producer(
                self.access, acks="all", retries=5, request_timeout_ms=ms, max_block_ms=ms, bootstrap_timeout_ms=ms
            )
        return _Ack(self.producer.send(topic, key=key, value=value), 2 * self.timeout_s)

    def _reset(self) -> None:
        """Drop the producer and what it still buffers: the spool has the event now, and a
        producer that delivered it later as well would only add a duplicate (which ingest drops)."""
        producer, self.producer = self.producer, None
        if producer is not None:
            try:
                producer.close(timeout=0)
            except Exception:  # noqa: BLE001 - closing a producer whose broker is away
                pass

    def _drain_loop(self) -> None:
        while not self.stopped.is_set():
            self.wake.wait(self.retry_s)
            self.wake.clear()
            if self.stopped.is_set() or not self.spool.pending():
                continue
            try:
                sent = self.spool.drain(
                    self._in_flight,
                    batch=1 if self.one_by_one else 500,
                    permanent=refused_for_good,
                    on_set_aside=self._reset,
                )
                self.one_by_one, self.refused = False, None
                if self.failing or not self.write_ahead:  # (write-ahead: every event passes here)
                    log.info("spooled events sent", extra={"topic": self.topic, "events": sent})
                self.failing = False
            except BatchRefused as exc:  # one record of a batch is too large: find it, one at a time
                self._reset()
                self.one_by_one = True
                self.wake.set()
                log.warning(
                    "a batch was refused for good; sending one record at a time to set aside the one at fault",
                    extra={"topic": self.topic, "error": str(exc)},
                )
                continue
            except kafka_client.REFUSALS as exc:  # wrong credentials or rights: loud, and told to the caller
                self._reset()
                self.failing, self.refused = True, f"{type(exc).__name__}: {exc}"
                log.error(
                    "Kafka refuses this producer: spooled events wait until its settings are fixed",
                    extra={"topic": self.topic, "spool": str(self.spool.dir), "error": self.refused},
                )
                continue
            except Exception as exc:  # noqa: BLE001 - the broker still away: the next try in retry_s
                self._reset()
                self.failing = True
                log.warning(
                    "spooled events not sent yet", extra={"topic": self.topic, "error": f"{type(exc).__name__}: {exc}"}
                )
                continue
            if self.write_ahead:
                # what arrives meanwhile goes out as one batch (and one spool segment), not one by one
                self.stopped.wait(self.spool.commit_s)

    def close(self) -> None:
        self.stopped.set()
        self.wake.set()
        if self.drainer is not None:
            self.drainer.join(timeout=2 * self.timeout_s)
            self.spool.close()
        if self.producer is not None:
            self.producer.close()


def refused_for_good(exc: Exception) -> bool:
    """The broker (or the producer before it) will never take this record, however often it is
    sent: larger than max_request_size / the topic's max.message.bytes, or invalid."""
    return isinstance(
        exc, (kerrors.MessageSizeTooLargeError, kerrors.RecordListTooLargeError, kerrors.InvalidRecordError)
    )


class _Ack:
    def __init__(self, future: Any, timeout_s: float) -> None:
        self.future, self.timeout_s = future, timeout_s

    def get(self) -> None:
        self.future.get(timeout=self.timeout_s)


class ModelUpdatePublisher(EventSender):
    def __init__(self, access: KafkaAccess | str, topic: str) -> None:
        super().__init__(access, topic, key="name")
