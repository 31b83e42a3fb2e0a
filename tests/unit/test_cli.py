"""The command line: every command explains itself, commands refuse a store that is behind with
the command that fixes it, bad configuration is refused naming the field, and the documented
configuration and docs stay true."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from pipeline.cli import cli
from pipeline.core.store import db as store_db
from tests.support.helpers import REPO

COMMANDS = [
    [],
    ["kafka"],
    ["kafka", "up"],
    ["kafka", "down"],
    ["kafka", "status"],
    ["kafka", "topics"],
    ["kafka", "topics", "create"],
    ["kafka", "topics", "check"],
    ["db"],
    ["db", "upgrade"],
    ["db", "downgrade"],
    ["db", "current"],
    ["ingest"],
    ["replay"],
    ["dead-letters"],
    ["dead-letters", "list"],
    ["dead-letters", "show"],
    ["dead-letters", "replay"],
    ["export"],
    ["status"],
    ["reward"],
    ["reward", "run"],
    ["reward", "explain"],
    ["reward", "diff"],
    ["reward", "recompute"],
    ["reward", "audit"],
    ["reward", "model"],
    ["reward", "model", "show"],
    ["reward", "model", "fit"],
    ["model"],
    ["model", "init-tiny"],
    ["model", "show"],
    ["train"],
    ["train", "run"],
    ["train", "show"],
    ["gate"],
    ["models"],
    ["models", "list"],
    ["models", "show"],
    ["promote"],
    ["rollback"],
    ["serve"],
    ["daemon"],
    ["demo"],
    ["sim"],
    ["gateway"],
]


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "rtrl")
def test_every_command_has_help(args):
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, result.output
    doc_lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(doc_lines) >= 3 and "Usage:" in result.output


def test_commands_refuse_a_store_that_is_behind(tmp_path):
    env = {"RTRL_STATE_DIR": str(tmp_path), "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    for args in (["status"], ["export", "-"], ["replay", "--dead-letters"], ["ingest"]):
        result = CliRunner().invoke(cli, args, env=env)
        assert result.exit_code != 0
        assert "run `rtrl db upgrade` first" in result.output, result.output


def test_db_upgrade_then_status_without_broker(tmp_path):
    env = {"RTRL_STATE_DIR": str(tmp_path), "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    runner = CliRunner()
    up = runner.invoke(cli, ["db", "upgrade"], env=env)
    assert up.exit_code == 0 and store_db.head_revision() in up.output, up.output
    assert runner.invoke(cli, ["db", "upgrade"], env=env).exit_code == 0  # re-run is a no-op
    status = runner.invoke(cli, ["status"], env=env)
    assert status.exit_code == 0, status.output
    assert (
        "interactions" in status.output
        and "cannot reach the Kafka broker at 127.0.0.1:1 (kafka.bootstrap)" in status.output
    )
    assert "cycles (no daemon holds the lease):" in status.output


def test_daemon_once_without_a_broker_says_which_setting_and_runs_no_cycle(tmp_path):
    env = {"RTRL_STATE_DIR": str(tmp_path), "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1", "RTRL_KAFKA__CONNECT_TIMEOUT_S": "1"}
    runner = CliRunner()
    assert runner.invoke(cli, ["db", "upgrade"], env=env).exit_code == 0
    once = runner.invoke(cli, ["daemon", "--once"], env=env)
    assert once.exit_code == 1 and "kafka.bootstrap" in once.output, once.output
    assert "Traceback" not in once.output
    status = runner.invoke(cli, ["status"], env=env)
    assert "cycles (no daemon holds the lease):" in status.output  # none ran, and the lease is free


def test_bad_config_is_refused_with_field_and_allowed_values(tmp_path):
    bad = tmp_path / "rtrl.toml"
    bad.write_text("[ingest]\nbatch_max_records = 0\n")
    result = CliRunner().invoke(cli, ["--config", str(bad), "status"])
    assert result.exit_code != 0
    assert "ingest.batch_max_records" in result.output and "greater than or equal to 1" in result.output
    bad.write_text("[ingest]\nbatch_size = 5\n")
    result = CliRunner().invoke(cli, ["--config", str(bad), "status"])
    assert "ingest.batch_size" in result.output and "Extra inputs are not permitted" in result.output


def test_the_documented_config_example_is_valid(tmp_path):
    from pipeline.core.config import load_config

    text = (REPO / "docs" / "configuration.md").read_text()
    section = text[text.index("## How settings are layered") :]
    example = section.split("```toml\n", 1)[1].split("```", 1)[0]
    # files the config checks exist
    for named in ("/etc/rtrl/kafka-ca.pem", "/run/secrets/kafka", "/run/secrets/rtrl-db"):
        here = tmp_path / named.rsplit("/", 1)[1]
        here.write_text("x")
        example = example.replace(named, str(here))
    (tmp_path / "rtrl.toml").write_text(example)
    cfg = load_config(tmp_path / "rtrl.toml", environ={})
    assert cfg.train.loss == "cispo" and cfg.mlflow.tracking_uri == "http://mlflow:5000"
    assert cfg.kafka.security.protocol == "SASL_SSL" and cfg.kafka_access.password() == "x"
    assert cfg.db_url == "postgresql+psycopg://rtrl:x@db:5432/rtrl"


def test_the_configuration_reference_in_docs_matches_the_config_models():
    from pipeline.core.config_reference import DOC, document

    current = DOC.read_text()
    assert current == document(current), (
        "docs/configuration.md is stale: python -m pipeline.core.config_reference --write"
    )


def test_the_docs_stand_alone():
    """The README and docs point at files of this repository only, and each one they link exists."""
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = page.read_text()
        assert "../shared" not in text and "DESIGN.md" not in text, page
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if not target.startswith("http"):
                assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


def test_environment_lists_and_tables_are_json_and_errors_name_the_variable(tmp_path):
    from pipeline.core.config import ConfigError, load_config

    # a JSON list was one topic named '["t"]'; a table could not be set from the environment at all
    cfg = load_config(environ={"RTRL_INGEST__TOPICS": '["a", "b"]', "RTRL_GATE__BOUNDS": '{"kl": {"max": 1.5}}'})
    assert cfg.ingest.topics == ["a", "b"] and cfg.gate.bounds["kl"].max == 1.5
    assert load_config(environ={"RTRL_INGEST__TOPICS": "a, b"}).ingest.topics == ["a", "b"]  # commas too
    with pytest.raises(ConfigError, match=r"RTRL_INGEST__TOPICS: .* read as JSON, and this is not valid JSON"):
        load_config(environ={"RTRL_INGEST__TOPICS": '["a",'})
    # a wrong value names the variable that set it, not the config file beside it
    (tmp_path / "rtrl.toml").write_text("[ingest]\nbatch_max_records = 10\n")
    with pytest.raises(ConfigError) as bad:
        load_config(tmp_path / "rtrl.toml", environ={"RTRL_GATE__BOUNDS": '{"kl": {"max_increase": -1}}'})
    assert "gate.bounds.kl.max_increase" in str(bad.value) and "(from RTRL_GATE__BOUNDS)" in str(bad.value)
    assert "rtrl.toml" not in str(bad.value)
    (tmp_path / "rtrl.toml").write_text("[ingest]\nbatch_max_records = 0\n")
    with pytest.raises(ConfigError, match=r"ingest.batch_max_records: .*\(in .*rtrl.toml\)"):
        load_config(tmp_path / "rtrl.toml", environ={})


def _store_error(env: dict[str, str], *args: str) -> str:
    result = CliRunner().invoke(cli, list(args or ["status"]), env={"RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1", **env})
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.output, result.exception)
    assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1, result.output
    return result.output


def test_a_store_that_cannot_be_used_is_one_line_naming_the_url_and_what_to_check(tmp_path):
    """A wrong scheme, or a SQLite folder that cannot be made: one line, no traceback."""
    out = _store_error({"RTRL_DB_URL": "postgres://rtrl:s3cret-pw@127.0.0.1:5432/rtrl"})
    assert "postgresql+psycopg://" in out and "s3cret-pw" not in out and "rtrl:***@" in out
    (tmp_path / "file").write_text("")
    out = _store_error({"RTRL_DB_URL": f"sqlite:///{tmp_path}/file/sub/rtrl.db"}, "db", "upgrade")
    assert f"cannot create the folder {tmp_path}/file/sub" in out and "store.url" in out


def test_an_unreachable_tracking_server_is_one_line_with_its_password_masked(tmp_path):
    env = {"RTRL_STATE_DIR": str(tmp_path), "RTRL_KAFKA_BOOTSTRAP": "127.0.0.1:1"}
    assert CliRunner().invoke(cli, ["db", "upgrade"], env=env).exit_code == 0
    env |= {"RTRL_MLFLOW__TRACKING_URI": "http://alice:tr4cking-pw@127.0.0.1:1", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}
    out = _store_error(env, "models", "list")
    assert "http://alice:***@127.0.0.1:1" in out and "mlflow.tracking_uri" in out and "tr4cking-pw" not in out


def test_every_secret_has_one_policy_environment_or_file_never_the_config_file(tmp_path):
    """The store's password and MLflow's credentials are refused in rtrl.toml as Kafka's are; the
    store's password comes from RTRL_DB_PASSWORD, store.password_file or RTRL_DB_URL; the settings
    file rtrl writes leaves every password out."""
    from pipeline.core.config import ConfigError, load_config, to_toml

    def refused(text: str) -> str:
        (tmp_path / "rtrl.toml").write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config(tmp_path / "rtrl.toml", environ={})
        assert "pw-in-file" not in str(err.value)
        return str(err.value)

    assert "store.password_file or RTRL_DB_PASSWORD" in refused(
        '[store]\nurl = "postgresql+psycopg://u:pw-in-file@db/r"\n'
    )
    assert "RTRL_DB_PASSWORD" in refused('[store]\nurl = "postgresql+psycopg://u@db/r"\npassword = "pw-in-file"\n')
    assert "MLFLOW_TRACKING_PASSWORD" in refused('[mlflow]\ntracking_uri = "https://u:pw-in-file@mlflow.example"\n')

    (tmp_path / "rtrl.toml").write_text('[store]\nurl = "postgresql+psycopg://u@db:5432/r"\n')
    from_env = load_config(tmp_path / "rtrl.toml", environ={"RTRL_DB_PASSWORD": "p@ss/word"})
    assert from_env.db_url == "postgresql+psycopg://u:p%40ss%2Fword@db:5432/r"
    secret = tmp_path / "db-secret"
    secret.write_text("from-file\n")
    from_file = load_config(tmp_path / "rtrl.toml", environ={"RTRL_STORE__PASSWORD_FILE": str(secret)})
    assert from_file.db_url == "postgresql+psycopg://u:from-file@db:5432/r"
    whole = load_config(environ={"RTRL_DB_URL": "postgresql+psycopg://u:env-pw@db/r"})
    assert whole.db_url.endswith("u:env-pw@db/r") and "env-pw" not in to_toml(whole)
    assert "u@db/r" in to_toml(whole) and "from-file" not in to_toml(from_file) and "p@ss" not in to_toml(from_env)
    with pytest.raises(ConfigError, match="no user"):
        _ = load_config(environ={"RTRL_DB_URL": "postgresql+psycopg://db/r", "RTRL_DB_PASSWORD": "x"}).db_url
