"""Malformed events and what ingest must say about each: shared by the decoder tests and the broker tests."""

from __future__ import annotations

import gzip

from tests.support.factories import encode, feedback, interaction

MAX = 64 * 1024  # the record size limit the cases are decoded under

BAD = {
    "invalid_utf8": b'{"schema_version": 1, "x": "\xff\xfe"}',
    "utf16_is_not_utf8": '{"schema_version": 1}'.encode("utf-16"),
    "malformed_json": b'{"schema_version": 1,',
    "nan_literal": b'{"schema_version": 1, "value": NaN}',
    "not_an_object": b"[1, 2, 3]",
    "empty": b"",
    "deep_nesting": b"[" * 30_000 + b"]" * 30_000,
    "newer_schema": encode(interaction(1, schema_version=2)),
    "missing_field": encode({k: v for k, v in interaction(1).items() if k != "completion"}),
    "wrong_type": encode(interaction(1, latency_ms="fast")),
    "unknown_type": encode(dict(interaction(1), type="purchase")),
    "naive_ts": encode(interaction(1, ts="2026-11-01T12:00:00")),
    "nul_in_id": encode(interaction(1, request_id="r\x00")),
    "lone_surrogate": b'{"schema_version":1,"event_id":"e","type":"feedback","ts":"2026-11-01T00:00:00Z",'
    b'"request_id":"r","kind":"thumbs","value":1,"payload":"\\ud800"}',
    "bool_schema_version": encode(interaction(1, schema_version=True)),
    "oversized": encode(interaction(1, size=MAX + 10)),
    "gzip_bytes": gzip.compress(encode(interaction(1))),
    # what later stages trust: the behaviour log-probs' sampling settings must be numbers
    "temperature_not_a_number": encode(interaction(1, sampling={"temperature": "auto"})),
    "top_p_a_list": encode(interaction(1, sampling={"temperature": 0.7, "top_p": [0.9]})),
    "negative_temperature": encode(interaction(1, sampling={"temperature": -1})),
    "feedback_value_at_float_max": encode(feedback(1, value=1.7976931348623157e308)),
}


EXPECTED = {
    "invalid_utf8": "invalid_utf8",
    "utf16_is_not_utf8": "invalid_utf8",
    "malformed_json": "malformed_json",
    "nan_literal": "malformed_json",
    "not_an_object": "malformed_json",
    "empty": "malformed_json",
    "deep_nesting": "malformed_json",
    "newer_schema": "unsupported_schema_version",
    "missing_field": "schema_violation",
    "wrong_type": "schema_violation",
    "unknown_type": "schema_violation",
    "naive_ts": "schema_violation",
    "nul_in_id": "schema_violation",
    "lone_surrogate": "malformed_json",
    "bool_schema_version": "schema_violation",
    "oversized": "oversized",
    "gzip_bytes": "invalid_utf8",
    "temperature_not_a_number": "schema_violation",
    "top_p_a_list": "schema_violation",
    "negative_temperature": "schema_violation",
    "feedback_value_at_float_max": "schema_violation",
}
