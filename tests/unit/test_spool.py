"""The spool that keeps what the broker did not acknowledge: in order across segments, a failed
send and a restart; a torn tail dropped; full refused (counted) or blocking; a record refused
for good set aside while the records behind it go on."""

from __future__ import annotations

import json
import threading

import pytest

from pipeline.core.spool import Spool, SpoolFull
from tests.support.spool import drained_values


def test_records_come_back_in_order_across_segments_a_failed_send_and_a_restart(tmp_path):
    spool = Spool(tmp_path, segment_bytes=120)
    for i in range(20):
        spool.append("t", b"k", json.dumps({"i": i}).encode())
    first = drained_values(spool, fail_after=7)  # the broker goes away after 7
    assert first == list(range(7)) and spool.pending()
    spool.close()
    again = Spool(tmp_path, segment_bytes=120)  # a restart: from the saved position
    rest = drained_values(again)
    assert rest[-13:] == list(range(7, 20)) and set(first + rest) == set(range(20))
    assert len(rest) - 13 <= 3  # at most a batch is sent twice (its position not yet saved)
    assert not again.pending() and again.size() == 0
    again.append("t", b"k", b'{"i": 20}')
    assert drained_values(again) == [20]


def test_a_record_torn_by_a_crash_ends_its_segment(tmp_path):
    spool = Spool(tmp_path)
    for i in range(3):
        spool.append("t", b"k", json.dumps({"i": i}).encode())
    spool.close()
    segment = next(tmp_path.glob("*.spool"))
    segment.write_bytes(segment.read_bytes()[:-5])  # the last record half written
    assert drained_values(Spool(tmp_path)) == [0, 1]


def test_a_full_spool_refuses_and_counts_or_blocks_until_drained(tmp_path):
    spool = Spool(tmp_path / "refuse", max_bytes=200)
    spool.append("t", b"k", b'{"i": 0}' + b" " * 100)
    with pytest.raises(SpoolFull, match="max 200"):
        spool.append("t", b"k", b'{"i": 1}' + b" " * 100)
    assert spool.refused == 1 and drained_values(spool) == [0]

    blocking = Spool(tmp_path / "block", max_bytes=200, when_full="block")
    blocking.append("t", b"k", b'{"i": 0}' + b" " * 100)
    appended = threading.Event()
    threading.Thread(target=lambda: (blocking.append("t", b"k", b'{"i": 1}'), appended.set()), daemon=True).start()
    assert not appended.wait(0.5)  # waits for room (no sleep as synchronisation: a bounded wait that must fail)
    assert drained_values(blocking) == [0]
    assert appended.wait(10) and drained_values(blocking) == [1]


def test_a_record_refused_for_good_is_set_aside_and_the_records_behind_it_go_on(tmp_path):
    """One record the broker will never take (too large) must not stop the drain: it goes to
    set-aside.jsonl with the error, counted; a passing failure still stops the drain there."""
    spool = Spool(tmp_path)
    for i in range(5):
        spool.append("t", b"k", json.dumps({"i": i, "pad": "x" * (100 if i == 2 else 0)}).encode())
    got: list[int] = []

    def send(topic, key, value):
        if len(value) > 50:
            raise OverflowError("too large for the topic")
        got.append(json.loads(value)["i"])

    assert spool.drain(send, batch=2, permanent=lambda exc: isinstance(exc, OverflowError)) == 5
    assert got == [0, 1, 3, 4] and not spool.pending() and spool.set_aside == 1
    (aside,) = [json.loads(line) for line in (tmp_path / "set-aside.jsonl").read_text().splitlines()]
    assert json.loads(aside["value"])["i"] == 2 and aside["error"].startswith("OverflowError")
    spool.append("t", b"k", b'{"i": 5}')
    with pytest.raises(ConnectionError):  # not refused for good: the drain stops, the record waits
        spool.drain(lambda *r: (_ for _ in ()).throw(ConnectionError("away")), permanent=lambda exc: False)
    assert spool.pending() and spool.set_aside == 1
