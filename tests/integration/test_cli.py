"""The command line: every command explains itself, `db upgrade` works from a wheel, and
commands refuse a store that is behind with the command that fixes it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
