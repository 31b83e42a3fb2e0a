"""`rtrl dead-letters list|show|replay` on both stores: the letters a file replay set aside are
listed newest first (by reason), shown with their bytes, and those a fix lets through are stored
once and their letters removed."""

from __future__ import annotations

from click.testing import CliRunner

from ingest.replay import replay_from_file
from pipeline.cli import cli
from pipeline.core.config import load_config
from pipeline.core.store.event_reads import dead_letter_list, table_counts
from tests.support.factories import encode, interaction


def test_dead_letters_are_listed_shown_and_replayed_after_a_fix(db_url, engine, tmp_path):
    cfg_env = {"RTRL_STATE_DIR": str(tmp_path / "state"), "RTRL_DB_URL": db_url}  # no broker needed
    big = interaction(1, prefix="dl", size=3000)  # over the 2,000-byte limit below, valid otherwise
    lines = [encode(interaction(0, prefix="dl")), b"{not json", encode(big), encode(interaction(2, prefix="dl"))]
    path = tmp_path / "events.ndjson"
    path.write_bytes(b"\n".join(lines) + b"\n")
    tight = {**cfg_env, "RTRL_INGEST__MAX_EVENT_BYTES": "2000"}
    replay_from_file(load_config(environ=tight), engine, str(path))
    assert table_counts(engine)["interactions"] == 2

    letters = dead_letter_list(engine)
    assert [d.reason for d in letters] == ["oversized", "malformed_json"]  # newest first
    assert letters[0].size == len(lines[2]) and letters[0].partition == -1 and letters[0].offset == 3

    runner = CliRunner()
    listed = runner.invoke(cli, ["dead-letters", "list"], env=cfg_env)
    assert listed.exit_code == 0, listed.output
    assert [line.split()[0] for line in listed.output.splitlines()] == [str(d.id) for d in letters]
    only = runner.invoke(cli, ["dead-letters", "list", "--reason", "malformed_json"], env=cfg_env)
    assert only.output.count("\n") == 1 and "malformed_json" in only.output

    shown = runner.invoke(cli, ["dead-letters", "show", str(letters[1].id)], env=cfg_env)
    assert shown.exit_code == 0 and "{not json" in shown.output and "malformed_json" in shown.output, shown.output
    cut = runner.invoke(cli, ["dead-letters", "show", str(letters[0].id)], env=cfg_env)
    assert f"bytes:  {len(lines[2])}" in cut.output
    missing = runner.invoke(cli, ["dead-letters", "show", "999999"], env=cfg_env)
    assert missing.exit_code == 1 and "no dead letter 999999" in missing.output

    dry = runner.invoke(cli, ["dead-letters", "replay", "--dry-run"], env=cfg_env)
    assert dry.exit_code == 0 and "dry run" in dry.output and len(dead_letter_list(engine)) == 2
    # the fix: the default limit (1 MiB) lets the large event through; bad JSON stays bad
    fixed = runner.invoke(cli, ["dead-letters", "replay"], env=cfg_env)
    assert fixed.exit_code == 0, fixed.output
    assert [d.reason for d in dead_letter_list(engine)] == ["malformed_json"]
    assert table_counts(engine)["interactions"] == 3
    again = runner.invoke(cli, ["dead-letters", "replay"], env=cfg_env)
    assert again.exit_code == 0 and table_counts(engine)["interactions"] == 3  # stored once
    assert (
        "no dead letters of reason oversized"
        in runner.invoke(cli, ["dead-letters", "list", "--reason", "oversized"], env=cfg_env).output
    )
