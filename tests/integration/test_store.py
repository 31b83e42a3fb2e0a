"""The store on SQLite and PostgreSQL: migrations, idempotent writes, export -> replay."""

from __future__ import annotations

import json

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, select

from ingest.batch import decode_records
from ingest.decode import decode
from ingest.ndjson import export_events
from ingest.replay import replay_dead_letters, replay_from_file
from pipeline.core.config import Config
from pipeline.core.store import db as store_db
from pipeline.core.store.event_reads import stored_offsets, table_counts
from pipeline.core.store.events import Rows, dead_letter_row, write_rows
from pipeline.core.store.online import online_units, served_and_accepted
from pipeline.core.store.tables import dead_letters, feedback, interactions, metadata
from pipeline.core.types import SourcePosition
from tests.support.factories import encode, interaction
from tests.support.factories import feedback as fb
from tests.support.scratch_db import restricted_role
from tests.support.stores import event_contents


def _rows(evs: list[dict], letters: list[bytes] = (), source="t") -> Rows:
    """Rows as ingest builds them: events at offsets 0.., then undecodable values after them."""
    raw = [encode(e) for e in evs] + list(letters)
    return decode_records([(source, 0, i, value) for i, value in enumerate(raw)], 1 << 20).rows


def test_migrations_upgrade_downgrade_upgrade(empty_db_url):
    store_db.upgrade(empty_db_url)
    engine = store_db.make_engine(empty_db_url)
    assert store_db.current_revision(engine) == store_db.head_revision()
    assert {"interactions", "feedback", "dead_letters", "consumer_offsets"} <= set(inspect(engine).get_table_names())
    store_db.downgrade(empty_db_url, "base")
    assert store_db.current_revision(engine) is None
    assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
    store_db.upgrade(empty_db_url)
    assert store_db.current_revision(engine) == store_db.head_revision()
    engine.dispose()


def test_models_and_migration_do_not_drift(engine):
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), metadata)
    assert diff == [], f"pipeline/core/store/tables.py and alembic/versions differ: {diff}"


def test_schema_check_names_the_fix(empty_db_url):
    engine = store_db.make_engine(empty_db_url)
    with pytest.raises(store_db.SchemaError, match="rtrl db upgrade"):
        store_db.require_current_schema(engine)
    store_db.upgrade(empty_db_url)
    store_db.require_current_schema(engine)
    engine.dispose()


def test_write_rows_is_idempotent_and_atomic_with_offsets(engine):
    rows = _rows([interaction(i) for i in range(5)] + [fb(i) for i in range(5)], [b"{"])
    first = write_rows(engine, rows, group_id="g", next_offsets={("t", 0): 100})
    assert first.inserted == {"interaction": 5, "feedback": 5} and first.dead_letters == 1
    twice = Rows(rows.interaction * 2, rows.feedback * 2, rows.dead_letters * 2)
    again = write_rows(engine, twice, group_id="g", next_offsets={("t", 0): 100})
    assert again.events == 0 and again.duplicates == 20 and again.dead_letters == 0
    counts = table_counts(engine)
    assert (counts["interactions"], counts["feedback"], counts["dead_letters"]) == (5, 5, 1)
    assert stored_offsets(engine, "g") == {("t", 0): 100}
    write_rows(engine, Rows(), group_id="g", next_offsets={("t", 0): 120, ("t", 1): 7})
    assert stored_offsets(engine, "g") == {("t", 0): 120, ("t", 1): 7}


def test_a_batch_gets_ids_in_log_order_and_a_repeat_within_it_is_stored_once(engine):
    """PostgreSQL writes a batch with COPY through a staging table: its rows must still be
    numbered in the order they were read (the reward stage reads feedback past a watermark of
    ids), a repeat inside one batch is a duplicate like a repeat across batches, and a second
    batch in the same session finds the staging table empty."""
    evs = [fb(i) for i in range(300)]
    first = write_rows(engine, _rows(evs + [evs[7]]))
    assert first.inserted["feedback"] == 300 and first.duplicates == 1
    second = write_rows(engine, _rows([fb(i) for i in range(290, 310)]))
    assert second.inserted["feedback"] == 10 and second.duplicates == 10
    with engine.connect() as conn:
        stored = conn.execute(select(feedback.c.event_id).order_by(feedback.c.id)).scalars().all()
    assert stored == [fb(i)["event_id"] for i in range(310)]


def test_a_role_that_may_not_create_temporary_tables_still_stores_batches(empty_db_url):
    """PostgreSQL's COPY path stages a batch in a temporary table; on a server that revokes
    TEMPORARY from the ingest role, batches are written by executemany instead of failing."""
    if not empty_db_url.startswith("postgresql"):
        pytest.skip("a PostgreSQL privilege")
    store_db.upgrade(empty_db_url)
    with restricted_role(
        empty_db_url,
        [
            "REVOKE TEMPORARY ON DATABASE {database} FROM PUBLIC",
            "GRANT CONNECT ON DATABASE {database} TO {role}",
            "GRANT USAGE ON SCHEMA public TO {role}",
            "GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA public TO {role}",
            "GRANT USAGE ON ALL SEQUENCES IN SCHEMA public TO {role}",
        ],
    ) as engine:
        assert write_rows(engine, _rows([fb(i) for i in range(5)])).inserted["feedback"] == 5
        assert write_rows(engine, _rows([fb(i) for i in range(7)])).inserted["feedback"] == 2


def test_export_then_replay_round_trips_exactly(engine, db_url, tmp_path):
    evs = [
        interaction(1, shiny={"x": [1, 2]}),
        interaction(
            2,
            completion=[{"role": "assistant", "content": "hi"}, {"role": "tool", "content": "ok"}],
            completion_token_ids=None,
            behavior_logprobs=None,
            sampling=None,
            metadata=None,
        ),
        fb(1, value=True),
        fb(2, kind="edited", value=0.5, payload={"text": "héllo ✓"}),
        fb(3, value=3),
    ]
    write_rows(engine, _rows(evs))
    out = tmp_path / "events.ndjson.gz"
    assert export_events(engine, str(out)) == len(evs)
    # into an empty SQLite store, from either backend
    other_url = f"sqlite:///{tmp_path / 'other.db'}"
    store_db.upgrade(other_url)
    other = store_db.make_engine(other_url)
    cfg = Config()
    report = replay_from_file(cfg, other, str(out))
    assert report.new_events == {"interaction": 2, "feedback": 3} and report.dead_letters == 0
    assert event_contents(other) == event_contents(engine)
    # and exporting the copy gives byte-identical output
    out2 = tmp_path / "again.ndjson.gz"
    export_events(other, str(out2))
    assert out2.read_bytes() == out.read_bytes()
    other.dispose()


def test_file_replay_twice_is_idempotent_and_dry_run_writes_nothing(engine, tmp_path):
    path = tmp_path / "in.ndjson"
    lines = [encode(interaction(i)) for i in range(20)] + [b"", b"{broken", encode(fb(1))]
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = Config()
    dry = replay_from_file(cfg, engine, str(path), dry_run=True)
    assert dry.new_events == {"interaction": 20, "feedback": 1} and dry.dead_letters == 1 and dry.blank_lines == 1
    assert table_counts(engine)["interactions"] == 0
    first = replay_from_file(cfg, engine, str(path))
    snapshot = event_contents(engine), table_counts(engine)
    second = replay_from_file(cfg, engine, str(path))
    assert first.new_events == {"interaction": 20, "feedback": 1}
    assert second.new_events == {"interaction": 0, "feedback": 0} and second.already_stored == 21
    assert (event_contents(engine), table_counts(engine)) == snapshot
    with engine.connect() as conn:
        letter = conn.execute(select(dead_letters)).one()
    assert letter.reason == "malformed_json" and letter.offset == 22 and letter.raw == b"{broken"


def test_dead_letter_retry_recovers_what_now_passes(engine):
    big = encode(interaction(7, size=5000))
    small_cfg = Config(ingest={"max_event_bytes": 1024})
    letters = [
        decode(big, SourcePosition(source="t", partition=0, offset=1), 1024),
        decode(b"not json", SourcePosition(source="t", partition=0, offset=2), 1024),
    ]
    write_rows(engine, Rows(dead_letters=[dead_letter_row(dl) for dl in letters]))
    assert replay_dead_letters(small_cfg, engine).recovered == 0
    # "after a fix": the size limit is raised
    report = replay_dead_letters(Config(), engine)
    assert (report.recovered, report.still_dead) == (1, 1)
    counts = table_counts(engine)
    assert (counts["interactions"], counts["dead_letters"]) == (1, 1)
    assert replay_dead_letters(Config(), engine).recovered == 0


def test_export_is_valid_ndjson(engine, tmp_path):
    write_rows(engine, _rows([interaction(1)]))
    out = tmp_path / "e.ndjson"
    export_events(engine, str(out))
    (line,) = out.read_text().splitlines()
    assert json.loads(line)["event_id"] == "ev-i-1"


def test_served_and_accepted_per_policy_version(engine):
    events = [interaction(i, policy_version=v) for i, v in enumerate(["1", "1", "1", "2", "2"])]
    events += [
        fb(0, kind="accepted"),
        fb(1, kind="accepted", value=False, event_id="no"),
        fb(1, kind="persisted", event_id="kept"),
        fb(3, kind="accepted"),
        fb(4, kind="rejected"),
    ]
    write_rows(engine, decode_records([("t", 0, i, encode(e)) for i, e in enumerate(events)], 1 << 20).rows)
    assert served_and_accepted(engine, ["1", "2", "3"]) == {"1": (3, 1), "2": (2, 1)}
    assert served_and_accepted(engine, []) == {}


def online_rewards(engine, *args, **kwargs):
    return {v: u.summary() for v, u in online_units(engine, *args, **kwargs).items()}


def test_online_rewards_per_version_since_a_time(engine):
    """A canary's online comparison (pipeline.cycle): n, mean and sample variance of the rewards
    of the requests each version served from a given time on."""
    from datetime import timedelta

    from pipeline.core.store.rewards import RewardRow, upsert_rewards
    from tests.support.factories import BASE_TS

    versions, values = ["1", "1", "1", "2", "2", "2", "2"], [9.0, 0.5, -0.5, 1.0, 0.0, 1.0, 0.0]
    # request 0 was served before the canary went live: it does not count
    events = [interaction(i, policy_version=v) for i, v in enumerate(versions)]
    write_rows(engine, decode_records([("t", 0, i, encode(e)) for i, e in enumerate(events)], 1 << 20).rows)
    upsert_rewards(
        engine, "spec@1", [RewardRow(f"ev-r-{i}", v, x, {}, 1, 0) for i, (v, x) in enumerate(zip(versions, values))]
    )
    upsert_rewards(engine, "spec@2", [RewardRow("ev-r-1", "1", 5.0, {}, 1, 0)])  # another spec's: not counted
    got = online_rewards(engine, "spec@1", ["1", "2"], (BASE_TS + timedelta(seconds=1)).replace(tzinfo=None))
    assert got["1"][:2] == (2, 0.0) and abs(got["1"][2] - 0.5) < 1e-9
    assert got["2"][:2] == (4, 0.5) and abs(got["2"][2] - 1 / 3) < 1e-9
    assert online_rewards(engine, "spec@1", ["3"], BASE_TS.replace(tzinfo=None)) == {}
    # only requests whose outcome is final: served up to `until`
    got = online_rewards(
        engine,
        "spec@1",
        ["1", "2"],
        (BASE_TS + timedelta(seconds=1)).replace(tzinfo=None),
        until=(BASE_TS + timedelta(seconds=5)).replace(tzinfo=None),
    )
    assert got["1"][:2] == (2, 0.0) and got["2"][0] == 3 and abs(got["2"][1] - 2 / 3) < 1e-9


def test_online_rewards_count_an_episode_once(engine):
    """An agent's episode is one unit of the online comparison: its calls' rewards averaged, so
    a version whose episodes make more calls does not weigh more (before, each call counted: a
    canary that used the tool on every episode -- two calls, both credited with a failure --
    lost to a champion that answered in one call while succeeding twice as often)."""
    from datetime import timedelta

    from pipeline.core.store.rewards import RewardRow, upsert_rewards
    from tests.support.factories import BASE_TS

    # version 1: one episode of three calls (-1, -1, -1) and one of one call (+1)
    # version 2: two requests without an episode (+1 and -1)
    spec = [
        ("1", "ep-a", -1.0),
        ("1", "ep-a", -1.0),
        ("1", "ep-a", -1.0),
        ("1", "ep-b", 1.0),
        ("2", None, 1.0),
        ("2", None, -1.0),
    ]
    events = [interaction(i, policy_version=v, **({"episode_id": e} if e else {})) for i, (v, e, _) in enumerate(spec)]
    write_rows(engine, decode_records([("t", 0, i, encode(e)) for i, e in enumerate(events)], 1 << 20).rows)
    upsert_rewards(engine, "spec@1", [RewardRow(f"ev-r-{i}", v, x, {}, 1, 0) for i, (v, _, x) in enumerate(spec)])
    got = online_rewards(engine, "spec@1", ["1", "2"], BASE_TS.replace(tzinfo=None) - timedelta(seconds=1))
    assert got["1"][:2] == (2, 0.0) and abs(got["1"][2] - 2.0) < 1e-9  # per call it was (4, -0.5)
    assert got["2"][:2] == (2, 0.0)


def test_an_episode_s_covariate_is_its_first_prompt_s_mean_reward_before_the_canary(engine):
    """CUPED's covariate (deploy/sequential.py): what the history before the canary went live
    earned on the prompt an episode began with (or its user) -- never a later call's prompt,
    which holds the policy's own answers; the history's overall mean for a prompt it never saw."""
    from datetime import timedelta

    from pipeline.core.store.rewards import RewardRow, upsert_rewards
    from tests.support.factories import BASE_TS

    # (version, prompt, user, episode, step, reward); requests 0-3 before the canary, 4- after
    rows = [
        ("base", "p1", "u1", None, None, 1.0),
        ("base", "p1", "u2", None, None, 0.0),
        ("base", "p2", "u1", None, None, -1.0),
        ("base", "p3", "u3", None, None, -0.5),
        ("1", "p1", "u3", None, None, 0.2),  # p1 earned 0.5 before
        ("1", "p9", "u1", None, None, 0.3),  # never seen: the overall mean, -0.125
        ("base", "p2", "u2", "ep-x", 1, 0.0),  # an episode that began with p2, then p1
        ("base", "p1", "u2", "ep-x", 2, 1.0),
    ]
    events = [
        interaction(i, policy_version=v, prompt=p, user_id=u, **({"episode_id": e, "step": s} if e else {}))
        for i, (v, p, u, e, s, _) in enumerate(rows)
    ]
    write_rows(engine, decode_records([("t", 0, i, encode(e)) for i, e in enumerate(events)], 1 << 20).rows)
    upsert_rewards(engine, "spec@1", [RewardRow(f"ev-r-{i}", r[0], r[5], {}, 1, 0) for i, r in enumerate(rows)])
    since = (BASE_TS + timedelta(seconds=4)).replace(tzinfo=None)
    got = online_units(engine, "spec@1", ["base", "1"], since, covariate="prompt", history=100)
    assert sorted(zip(got["1"].rewards, got["1"].covariates)) == [(0.2, 0.5), (0.3, -0.125)]
    assert got["base"].rewards == [0.5] and got["base"].covariates == [-1.0]  # ep-x: p2's
    by_user = online_units(engine, "spec@1", ["1"], since, covariate="user", history=100)
    assert sorted(zip(by_user["1"].rewards, by_user["1"].covariates)) == [(0.2, -0.5), (0.3, 0.0)]
    # the history is the most recent calls only: the last two (p2 -1.0, p3 -0.5)
    recent = online_units(engine, "spec@1", ["1"], since, covariate="prompt", history=2)
    assert sorted(recent["1"].covariates) == [-0.75, -0.75]
    assert online_units(engine, "spec@1", ["1"], since)["1"].covariates == [0.0, 0.0]


TRAJECTORY = [
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [{"function": {"name": "read", "arguments": '{"path": "a.py"}'}}],
    },
    {"role": "tool", "content": "def f(): ..."},
    {"role": "assistant", "content": "Fixed."},
]


def _outputs(engine) -> dict[str, tuple]:
    cols = interactions.c
    with engine.connect() as conn:
        rows = conn.execute(select(cols.request_id, cols.output_text, cols.output_tool_calls, cols.expects_attempt))
        return {r[0]: (r[1], json.loads(r[2]) if r[2] is not None else None, bool(r[3])) for r in rows}


def test_ingest_stores_what_the_policy_wrote_beside_the_body(engine):
    """The reward stage reads these columns instead of parsing bodies: assistant turns only (a
    tool's output is not the policy's), tool calls as sent, expects_attempt from the metadata."""
    write_rows(
        engine,
        _rows(
            [
                interaction(1),
                interaction(2, completion=TRAJECTORY, metadata={"expects_attempt": False}),
                interaction(3, completion=""),
            ]
        ),
    )
    got = _outputs(engine)
    assert got["ev-r-1"] == (interaction(1)["completion"], None, True)
    assert got["ev-r-2"] == ("Let me look.\nFixed.", TRAJECTORY[0]["tool_calls"], False)
    assert got["ev-r-3"] == ("", None, True)


def test_migration_fills_the_outputs_of_interactions_stored_before_it(empty_db_url):
    """0008 adds the output columns and fills them from the bodies already in the store, in
    batches: the same values ingest writes for a new event."""
    from sqlalchemy import MetaData, Table

    store_db.upgrade(empty_db_url, "0007")
    engine = store_db.make_engine(empty_db_url)
    old = Table("interactions", MetaData(), autoload_with=engine)
    events = [interaction(1), interaction(2, completion=TRAJECTORY, metadata={"expects_attempt": False})]
    rows = [
        {k: v for k, v in row.items() if k in old.c} | {"ingested_at": row["ts"]} for row in _rows(events).interaction
    ]
    with engine.begin() as conn:
        conn.execute(old.insert(), rows)
    store_db.upgrade(empty_db_url)
    assert _outputs(engine) == {
        "ev-r-1": (interaction(1)["completion"], None, True),
        "ev-r-2": ("Let me look.\nFixed.", TRAJECTORY[0]["tool_calls"], False),
    }
    engine.dispose()
