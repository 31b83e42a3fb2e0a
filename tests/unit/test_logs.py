"""Structured logs: every field a call passes reaches the JSON line, in either style."""

from __future__ import annotations

import json
import logging
import re

from pipeline.core.logs import JsonFormatter
from tests.support.helpers import REPO


def _line(call) -> dict:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("rtrl.test.logs")
    handler = Keep()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        call(log)
    finally:
        log.removeHandler(handler)
    return json.loads(JsonFormatter().format(records[-1]))


def test_plain_extra_fields_reach_the_line():
    # the daemon's "cycle failed" and "lease heartbeat failed" were logged without these
    out = _line(lambda log: log.error("lease heartbeat failed", extra={"error": "store away", "cycle": "c-1"}))
    assert out["msg"] == "lease heartbeat failed" and out["error"] == "store away" and out["cycle"] == "c-1"


def test_fields_dict_is_spread_into_the_line():
    out = _line(lambda log: log.info("batch stored", extra={"fields": {"events": 500, "dead_letters": 2}}))
    assert out["events"] == 500 and out["dead_letters"] == 2 and "fields" not in out


def test_exception_and_odd_values_are_written():
    def call(log):
        try:
            raise ValueError("boom")
        except ValueError:
            log.exception("cycle failed", extra={"cycle": "c-2", "partitions": [("t", 0)], "obj": object()})

    out = _line(call)
    assert out["cycle"] == "c-2" and out["partitions"] == [["t", 0]] and "ValueError: boom" in out["exc"]


def test_one_convention_in_the_code():
    """Calls pass fields as plain `extra={...}`; the nested style is only tolerated."""
    offenders = [
        str(p.relative_to(REPO))
        for pkg in ("ingest", "reward", "train", "deploy", "pipeline")
        for p in (REPO / pkg).rglob("*.py")
        if p.name != "logs.py" and re.search(r"extra=\{\s*\"fields\"", p.read_text())
    ]
    assert offenders == []


def test_a_tracking_uri_is_printed_and_stored_without_its_credentials():
    from pipeline.core.logs import redacted_uri

    assert (
        redacted_uri("https://alice:s3cret@mlflow.example:5000/api?token=t0k")
        == "https://alice:***@mlflow.example:5000/api"
    )
    assert redacted_uri("postgresql+psycopg://rtrl:pw@db:5432/mlflow") == "postgresql+psycopg://rtrl:***@db:5432/mlflow"
    assert redacted_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redacted_uri("sqlite:////var/rtrl/mlflow.db") == "sqlite:////var/rtrl/mlflow.db"
