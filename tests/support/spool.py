"""Reading back what a spool sends, for the spool tests of both layers."""

from __future__ import annotations

import json

from pipeline.core.spool import Spool


def drained_values(spool: Spool, fail_after: int | None = None) -> list[int]:
    got: list[int] = []

    def send(topic, key, value):
        if fail_after is not None and len(got) >= fail_after:
            raise ConnectionError("broker away")
        assert topic == "t" and key == b"k"
        got.append(json.loads(value)["i"])

    try:
        spool.drain(send, batch=3)
    except ConnectionError:
        pass
    return got
