"""The local broker's commands without a broker: status when none runs, and one clear line
without Java or Maven."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from pipeline import kafka_local
from pipeline.cli import cli
from pipeline.core.config import Config


def test_status_when_not_running(tmp_path):
    result = CliRunner().invoke(cli, ["kafka", "status"], env={"RTRL_STATE_DIR": str(tmp_path)})
    assert result.exit_code == 1 and "not running (start it with `rtrl kafka up`)" in result.output


@pytest.mark.parametrize("missing", ["java", "mvn"])
def test_without_java_or_maven_one_clear_line(tmp_path, monkeypatch, missing):
    # the other tool is there, whatever this machine has
    monkeypatch.setattr(kafka_local.shutil, "which", lambda name: None if name == missing else f"/usr/bin/{name}")
    monkeypatch.setenv("RTRL_CACHE_DIR", str(tmp_path / "cache"))  # no cached jars: Maven is needed
    cfg = Config(state_dir=tmp_path)
    with pytest.raises(kafka_local.KafkaLocalError) as err:
        kafka_local.up(cfg, progress=lambda msg: None)
    message = str(err.value)
    assert "\n" not in message and ("Java" if missing == "java" else "Maven") in message
    assert "install" in message
