"""The command line installed from a wheel: `db upgrade` finds its migrations, and a demo whose
broker port is taken says what to do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from pipeline.cli import cli
from tests.support.helpers import REPO


def test_db_upgrade_works_from_a_wheel_install(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("rtrl-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert (target / "rtrl_alembic" / "versions").is_dir()
    # run the installed copy, not the editable checkout: drop the editable finder, away from the repo
    code = (
        "import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]; "
        f"sys.path.insert(0, {str(target)!r}); "
        "import pipeline, pipeline.core.store.db as d; "
        "assert pipeline.__file__.startswith(sys.path[0]), pipeline.__file__; "
        "print('migrations', d.migrations_dir()); from pipeline.cli import main; main()"
    )
    env = dict(os.environ, RTRL_STATE_DIR=str(tmp_path / "state"))
    out = subprocess.run(
        [sys.executable, "-c", code, "db", "upgrade"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"migrations {target}" in out.stdout and "is at revision" in out.stdout
    assert Path(tmp_path / "state" / "rtrl.db").exists()


def test_a_demo_whose_broker_port_is_taken_says_what_to_do_without_a_traceback(tmp_path):
    """Another demo's broker still up on the port: the error names the port and the command that
    frees it, as a usage error (it was a traceback)."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"RTRL_STATE_DIR": str(tmp_path), "RTRL_KAFKA__PORT": str(port)}
        result = CliRunner().invoke(cli, ["demo", "--cycles", "1", "--verbose"], env=env)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert f"Error: port {port} on 127.0.0.1 is taken" in result.output and "rtrl kafka down" in result.output
