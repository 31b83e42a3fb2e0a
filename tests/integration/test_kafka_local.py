"""The local broker's status of the session's running broker."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline.cli import cli


def test_status_reports_the_session_broker(local_kafka_env, kafka_bootstrap):
    if local_kafka_env is None:
        pytest.skip("RTRL_KAFKA_BOOTSTRAP points at a broker this suite did not start")
    result = CliRunner().invoke(cli, ["kafka", "status"], env=local_kafka_env)
    assert result.exit_code == 0, result.output
    assert "serving, pid" in result.output and kafka_bootstrap in result.output
    again = CliRunner().invoke(cli, ["kafka", "up"], env=local_kafka_env)
    assert again.exit_code == 0 and "already running" in again.output
