"""A short `rtrl demo --gateway`, as a newcomer runs it: its settings sit under the user's environment (the
port of this session's broker, a base model of one's own), the terminal shows progress and
decisions but no log lines, and every command it prints at the end looks around what it did."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import requests

from tests.support.helpers import REPO, free_port, wait_for

pytestmark = pytest.mark.kafka


def rtrl(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], env=env, capture_output=True, text=True, timeout=timeout
    )


def test_a_short_demo_honours_overrides_keeps_logs_off_the_terminal_and_its_commands_look_around(
    local_kafka_env, reverse_base, tmp_path
):
    if local_kafka_env is None:
        pytest.skip("needs this session's local broker (RTRL_KAFKA_BOOTSTRAP points elsewhere)")
    # the session broker's state folder and port: with the override ignored, the demo would
    # start a second broker on 19092
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("RTRL_")},
        **local_kafka_env,
        "RTRL_TRAIN__BASE_MODEL": str(reverse_base),
        "OMP_NUM_THREADS": "1",
        # the demo's sequential canary may run to 800 settled requests a side; one cycle here needs a
        # decision, not its power
        "RTRL_ROLLOUT__MIN_REQUESTS": "40",
        "RTRL_ROLLOUT__MAX_REQUESTS": "120",
    }
    # through `rtrl gateway` in front of `rtrl serve` (the plain demo is `make demo`'s): the gateway
    # captures every request and routes the canary's share
    done = rtrl(
        ["demo", "--gateway", "--cycles", "1", "--every", "10s", "--measure", "20", "--timeout", "400"],
        env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    terminal = (done.stdout + done.stderr).splitlines()
    routed = next(line for line in terminal if line.startswith("Requests captured and routed by"))
    assert "rtrl-gateway" in routed and "rtrl-serve" not in routed, routed
    assert not [line for line in terminal if line.lstrip().startswith("{")], "JSON log lines on the terminal"
    assert any(" decision on v" in line for line in terminal), terminal
    assert any("keeps running" in line and "kafka down` stops it" in line for line in terminal), terminal
    assert not any("FutureWarning" in line for line in terminal)

    run_dir = Path(local_kafka_env["RTRL_STATE_DIR"]) / "demo"
    settings = tomllib.loads((run_dir / "rtrl.toml").read_text())
    assert settings["kafka"]["port"] == int(local_kafka_env["RTRL_KAFKA__PORT"])
    assert settings["train"]["base_model"] == str(reverse_base)
    assert (settings["rollout"]["min_requests"], settings["rollout"]["max_requests"]) == (40, 120)
    assert '"logger"' in (run_dir / "demo.log").read_text()  # the structured logs went to the file
    assert (run_dir / "report" / "report.png").stat().st_size > 0

    # the benchmark that reads a finished demo still reads this one (tests/integration/test_benchmarks.py: the others)
    offpolicy = subprocess.run(
        [
            sys.executable,
            "benchmarks/offpolicy_vs_online.py",
            "--state-dir",
            local_kafka_env["RTRL_STATE_DIR"],
            "--min-served",
            "1",
            "--truth-tasks",
            "20",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert offpolicy.returncode == 0 and "SNIS" in offpolicy.stdout and "direct*" in offpolicy.stdout, offpolicy.stderr[
        -3000:
    ]

    commands = [shlex.split(line.strip()) for line in done.stdout[done.stdout.index("look around") :].splitlines()[1:]]
    names = [" ".join(c[3:5]) if c[0] == "rtrl" else c[0] for c in commands]
    assert {"status", "models list", "reward audit", "train show", "mlflow"} <= set(names), names
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}  # only the written file
    for command in commands:
        if command[0] == "rtrl":
            result = rtrl(command[1:], clean)
            assert result.returncode == 0 and result.stdout.strip(), (command, result.stderr[-2000:])
        else:  # mlflow ui on the run's tracking store answers
            port = free_port()
            mlflow = str(Path(sys.executable).with_name("mlflow"))  # the venv's, PATH or not
            ui = subprocess.Popen(
                [mlflow, *command[1:], "--host", "127.0.0.1", "--port", str(port)],
                env=clean,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            try:
                wait_for(lambda: _answers(f"http://127.0.0.1:{port}/"), 90, "mlflow ui to answer", interval=0.5)
            finally:
                ui.terminate()
                ui.wait(timeout=30)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False
