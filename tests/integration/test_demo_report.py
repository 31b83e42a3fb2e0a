"""The demo's report: accept rates per served version from the store, their intervals, the headline."""

from __future__ import annotations

import json
from datetime import datetime, timedelta

import pytest

from pipeline.core.store.deploys import record_decision
from pipeline.core.store.events import Rows, write_rows
from pipeline.core.store.online import served_and_accepted
from pipeline.demo.report import DemoReport, collect, headline, per_version, wilson, write_report

T0 = datetime(2026, 11, 1)


def _served(engine, version: str, n: int, accepted: int, at=T0) -> None:
    """n requests served by `version`, the first `accepted` of them accepted (twice: a user may
    send the same kind again, and a request counts once)."""
    rows = Rows()
    offsets = iter(range(10**6))
    source = f"test-{version}"
    for i in range(n):
        rid = f"{version}-{i}"
        rows.interaction.append(
            {
                "event_id": f"i-{rid}",
                "request_id": rid,
                "schema_version": 1,
                "ts": at,
                "session_id": "s",
                "user_id": "u",
                "tenant": "t",
                "policy_version": version,
                "body": json.dumps({"completion": "x"}),
                "output_text": "x",
                "output_tool_calls": None,
                "expects_attempt": True,
                "source": source,
                "partition": 0,
                "offset": next(offsets),
            }
        )
        for j in range(2 if i < accepted else 0):
            rows.feedback.append(
                {
                    "event_id": f"f-{rid}-{j}",
                    "request_id": rid,
                    "schema_version": 1,
                    "ts": at + timedelta(seconds=1 + j),
                    "kind": "accepted",
                    "value": 1.0,
                    "body": "{}",
                    "source": source,
                    "partition": 0,
                    "offset": next(offsets),
                }
            )
        if i >= accepted:
            rows.feedback.append(
                {
                    "event_id": f"r-{rid}",
                    "request_id": rid,
                    "schema_version": 1,
                    "ts": at + timedelta(seconds=1),
                    "kind": "rejected",
                    "value": 1.0,
                    "body": "{}",
                    "source": source,
                    "partition": 0,
                    "offset": next(offsets),
                }
            )
            # an `accepted` event whose value is false is no accept (the demo once counted it)
            rows.feedback.append(
                {
                    "event_id": f"n-{rid}",
                    "request_id": rid,
                    "schema_version": 1,
                    "ts": at + timedelta(seconds=2),
                    "kind": "accepted",
                    "value": 0.0,
                    "body": "{}",
                    "source": source,
                    "partition": 0,
                    "offset": next(offsets),
                }
            )
    write_rows(engine, rows)


def test_wilson_interval_contains_the_rate_and_narrows_with_n():
    for k, n in [(0, 10), (3, 10), (10, 10), (30, 100), (300, 1000)]:
        lo, hi = wilson(k, n)
        assert 0.0 <= lo <= k / n <= hi <= 1.0
    assert wilson(0, 0) == (0.0, 1.0)
    small, large = wilson(5, 25), wilson(200, 1000)
    assert large[1] - large[0] < small[1] - small[0]
    lo, hi = wilson(9, 25)  # 36 % of 25: a wide interval, about 20-55 %
    assert lo == pytest.approx(0.202, abs=0.005) and hi == pytest.approx(0.555, abs=0.005)


def test_per_version_counts_each_accepted_request_once_as_the_store_defines_it(engine):
    _served(engine, "base", 40, 5)
    _served(engine, "2", 20, 9)
    versions = per_version(engine, "no-such-spec")
    assert [v["version"] for v in versions] == ["base", "2"]
    base, v2 = versions
    assert (base["served"], base["accept_rate"]) == (40, 5 / 40)
    assert (v2["served"], v2["accept_rate"]) == (20, 9 / 20)
    assert v2["accept_ci95"] == pytest.approx(wilson(9, 20))
    assert v2["reward_mean"] is None
    assert served_and_accepted(engine) == {"base": (40, 5), "2": (20, 9)}  # the one definition


def test_headline_and_report_name_the_last_champion(engine, tmp_path):
    _served(engine, "base", 40, 5)
    _served(engine, "1", 30, 12)
    _served(engine, "2", 20, 9)
    report = DemoReport(versions=per_version(engine, "no-such-spec"), champion="2", seconds=12.0)
    line = headline(report.versions, "2")
    assert "base 12.5 % of 40" in line and "v2 45.0 % of 20" in line and "+32.5 pp" in line
    assert "No version was promoted" in headline(report.versions, "base")
    md, data = [f for f in write_report(report, tmp_path / "report", naive=False) if f.suffix in (".md", ".json")]
    assert line in md.read_text()
    assert json.loads(data.read_text())["champion"] == "2"


def test_the_report_shows_the_accept_rate_over_time_with_each_decision_marked(engine, tmp_path):
    _served(engine, "base", 40, 5, at=T0)
    _served(engine, "1", 30, 12, at=T0 + timedelta(minutes=2, seconds=10))
    record_decision(engine, "m", "1", None, "run-1", True, {"decision": {"passed": True, "checks": []}})
    record_decision(
        engine,
        "m",
        "2",
        "1",
        "run-2",
        False,
        {
            "decision": {
                "passed": False,
                "checks": [
                    {"name": "bound:abstention_rate", "passed": False, "detail": "abstention_rate 0.4 (max 0.3)"}
                ],
            }
        },
    )
    report = collect(engine, "no-such-spec", "m", "1", 3.0)
    assert [(b["minute"], b["served"], b["accept_rate"]) for b in report.timeline] == [
        (0.0, 40, 5 / 40),
        (2.0, 30, 12 / 30),
    ]
    lo, hi = report.timeline[1]["accept_ci95"]
    assert lo < 12 / 30 < hi
    assert [(m["kind"], m["label"]) for m in report.markers] == [("rejected", "v2 (gate)")]
    data = [f for f in write_report(report, tmp_path / "report", naive=False) if f.suffix == ".json"][0]
    assert json.loads(data.read_text())["timeline"][1]["served"] == 30
