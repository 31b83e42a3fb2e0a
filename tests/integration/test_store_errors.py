"""A PostgreSQL store that refuses the connection, lacks the database or is away: every command
says so in one line (the URL with its password masked, the server's words, what to check)."""

from __future__ import annotations

import os

import pytest
from click.testing import CliRunner

from pipeline.cli import cli

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _store_error(env: dict[str, str], *args: str) -> str:
    result = CliRunner().invoke(cli, list(args or ["status"]), env={"RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1", **env})
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


@pytest.mark.postgres
def test_a_postgresql_store_that_refuses_or_is_away_is_one_line_with_its_diagnosis():
    """A wrong password, a missing database, a server that is down: each is one line with the
    URL (password masked), the server's own words and what to check; the password never shows."""
    from sqlalchemy.engine import make_url

    admin = os.environ.get("RTRL_TEST_POSTGRES")
    if not admin:
        if IN_CI:
            pytest.fail("RTRL_TEST_POSTGRES is unset in CI: .ci/run must start PostgreSQL")
        pytest.skip("needs RTRL_TEST_POSTGRES")
    url = make_url(admin)
    wrong = url.set(password="wrong-pw-123").render_as_string(hide_password=False)
    out = _store_error({"RTRL_DB_URL": wrong})
    assert "password authentication failed" in out and "the user or password in store.url is wrong" in out
    assert "wrong-pw-123" not in out
    missing = url.set(database="rtrl_no_such_db").render_as_string(hide_password=False)
    out = _store_error({"RTRL_DB_URL": missing}, "db", "upgrade")
    assert '"rtrl_no_such_db" does not exist' in out and "createdb" in out
    down = url.set(port=1).render_as_string(hide_password=False)
    out = _store_error({"RTRL_DB_URL": down})
    assert "Connection refused" in out and "is PostgreSQL up" in out
