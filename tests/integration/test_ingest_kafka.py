"""Ingest against the real broker, on SQLite and PostgreSQL: exactly N rows even when the
ingest process is SIGKILLed mid-stream, bad input lands in dead letters, compressed batches
are read, SIGTERM stops cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, TopicPartition
from sqlalchemy import select

from ingest.consumer import run_ingest
from pipeline.core.store.event_reads import stored_offsets, table_counts
from pipeline.core.store.tables import dead_letters, feedback, interactions
from tests.support.decode_cases import BAD, EXPECTED
from tests.support.factories import encode, interaction
from tests.support.factories import feedback as fb
from tests.support.helpers import REPO, wait_for
from tests.support.kafka_events import count, ingest_until_caught_up, produce

pytestmark = pytest.mark.kafka


def child_pids(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def ids(engine, table) -> list[str]:
    with engine.connect() as conn:
        return list(conn.scalars(select(table.c.event_id)))


@pytest.mark.parametrize("lanes", [0, 1, 2])
def test_produce_n_ingest_exactly_n(cfg, engine, topics, kafka_bootstrap, lanes):
    cfg.ingest.lanes = lanes  # in-process, one worker process, partitions split over two
    n = 1500
    evs = [interaction(i) for i in range(n)]
    produce(
        kafka_bootstrap, topics["interactions"], [encode(e) for e in evs], keys=[e["request_id"].encode() for e in evs]
    )
    produce(
        kafka_bootstrap,
        topics["feedback"],
        [encode(fb(i)) for i in range(300)],
        keys=[f"ev-r-{i}".encode() for i in range(300)],
    )
    stats = ingest_until_caught_up(cfg, engine)
    assert stats.events == n + 300 and stats.dead_letters == 0
    assert count(engine, interactions) == n and count(engine, feedback) == 300
    # stored offsets cover everything; the same offsets were committed to Kafka
    offsets = stored_offsets(engine, cfg.ingest.group_id)
    assert sum(o for (t, _), o in offsets.items() if t == topics["interactions"]) == n
    check = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=cfg.ingest.group_id, enable_auto_commit=False)
    committed = {tp: check.committed(TopicPartition(*tp)) for tp in offsets}
    check.close()
    assert committed == offsets
    # a second run finds nothing new
    again = ingest_until_caught_up(cfg, engine)
    assert again.events == 0 and count(engine, interactions) == n


def test_sigkill_mid_stream_still_exactly_n(cfg_env, cfg, engine, topics, kafka_bootstrap):
    n = 12_000
    evs = [interaction(i, prefix="k") for i in range(n)]
    produce(
        kafka_bootstrap, topics["interactions"], [encode(e) for e in evs], keys=[e["request_id"].encode() for e in evs]
    )
    env = dict(os.environ, **cfg_env, RTRL_INGEST__BATCH_MAX_RECORDS="150", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "ingest", "--no-progress"]
    kills = 0
    for threshold in (500, 2500, 5000, 8000):
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for(
                lambda: count(engine, interactions) >= threshold or proc.poll() is not None,
                timeout=120,
                what=f"{threshold} rows",
            )
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            children = child_pids(proc.pid)
            proc.send_signal(signal.SIGKILL)
            kills += 1
            # its decoder process notices and leaves; no orphan keeps running
            wait_for(lambda: not any(alive(c) for c in children), timeout=30, what="decoder exit")
        finally:
            proc.wait(timeout=30)
            proc.stderr.close()
        assert count(engine, interactions) < n, "killed too late to test anything"
    assert kills == 4
    final = subprocess.run(cmd + ["--until-caught-up"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    stored = ids(engine, interactions)
    assert len(stored) == n and set(stored) == {e["event_id"] for e in evs}
    assert sum(stored_offsets(engine, cfg.ingest.group_id).values()) == n


def test_every_bad_input_class_lands_in_dead_letters(cfg, engine, topics, kafka_bootstrap):
    cfg.ingest.max_event_bytes = 64 * 1024  # the limit the BAD cases were built for
    values = [BAD[c] for c in sorted(BAD)]
    produce(kafka_bootstrap, topics["feedback"], values)
    produce(kafka_bootstrap, topics["feedback"], [encode(fb(1))])
    stats = ingest_until_caught_up(cfg, engine)
    assert stats.events == 1 and stats.dead_letters == len(BAD)
    with engine.connect() as conn:
        rows = conn.execute(select(dead_letters)).all()
    by_raw = {r.raw: r for r in rows}
    for case in sorted(BAD):
        row = by_raw[BAD[case]]
        assert row.reason == EXPECTED[case], case
        assert row.source == topics["feedback"] and row.offset >= 0 and row.detail


def test_nul_characters_never_halt_ingest(cfg, engine, topics, kafka_bootstrap):
    """PostgreSQL text cannot hold NUL: one such record used to fail its batch's transaction,
    and ingest restarted at the same offset forever. Poison first, then good records."""
    poison = [
        interaction(0, prefix="nul", completion="a\x00b"),  # what the policy wrote: a column
        interaction(1, prefix="nul", prompt=[{"role": "user", "content": "x\x00y"}]),
        interaction(
            2,
            prefix="nul",
            completion=[
                {
                    "role": "assistant",
                    "content": "\x00",
                    "tool_calls": [{"type": "function", "function": {"name": "f\x00", "arguments": "{}"}}],
                }
            ],
        ),
        {**fb(3, prefix="nul"), "type": "feed\x00back"},  # a dead letter whose detail names the bad type
    ]
    good = [interaction(i, prefix="ok") for i in range(50)]
    produce(kafka_bootstrap, topics["interactions"], [encode(e) for e in poison + good])
    stats = ingest_until_caught_up(cfg, engine)
    assert stats.events == 53 and stats.dead_letters == 1
    assert set(ids(engine, interactions)) >= {e["event_id"] for e in good}
    with engine.connect() as conn:
        stored = {r.event_id: r for r in conn.execute(select(interactions))}
        letter = conn.execute(select(dead_letters)).one()
    # the body keeps the event as sent; the column has U+FFFD where the NUL was
    assert stored["nul-i-0"].output_text == "a\ufffdb" and '"a\\u0000b"' in stored["nul-i-0"].body
    assert "\\u0000" in stored["nul-i-1"].body and "\\u0000" in stored["nul-i-2"].output_tool_calls
    assert letter.reason == "schema_violation" and "\x00" not in letter.detail and letter.raw == encode(poison[3])


def test_an_event_the_store_refuses_is_a_dead_letter_not_a_halt(cfg, engine, topics, kafka_bootstrap):
    """Any value the store will not hold (here a trigger refuses one event, as an operator's
    constraint or a type the contract let through would) used to fail its batch at every retry:
    ingest halted at that offset for good."""
    from sqlalchemy import text

    with engine.begin() as conn:
        if engine.dialect.name == "sqlite":
            conn.execute(
                text(
                    "CREATE TRIGGER refuse BEFORE INSERT ON interactions WHEN NEW.event_id LIKE 'bad-%' "
                    "BEGIN SELECT RAISE(ABORT, 'refused by a trigger'); END"
                )
            )
        else:
            conn.execute(
                text(
                    "CREATE FUNCTION refuse() RETURNS trigger AS $$ BEGIN IF NEW.event_id LIKE 'bad-%' "
                    "THEN RAISE EXCEPTION 'refused by a trigger' USING ERRCODE = '22023'; END IF; "
                    "RETURN NEW; END $$ LANGUAGE plpgsql"
                )
            )
            conn.execute(
                text("CREATE TRIGGER refuse BEFORE INSERT ON interactions FOR EACH ROW EXECUTE FUNCTION refuse()")
            )
    evs = [interaction(0, prefix="bad")] + [interaction(i, prefix="ok") for i in range(40)]
    produce(kafka_bootstrap, topics["interactions"], [encode(e) for e in evs])
    stats = ingest_until_caught_up(cfg, engine)
    assert stats.events == 40 and stats.dead_letters == 1
    assert set(ids(engine, interactions)) == {f"ok-i-{i}" for i in range(40)}
    with engine.connect() as conn:
        letter = conn.execute(select(dead_letters)).one()
    assert letter.reason == "store_refused" and "refused by a trigger" in letter.detail and letter.raw == encode(evs[0])
    assert sum(stored_offsets(engine, cfg.ingest.group_id).values()) == 41  # past the refused one


def test_a_new_store_starts_at_the_beginning_not_at_kafkas_committed_offset(cfg, engine, topics, kafka_bootstrap):
    """The group's offsets committed in Kafka belong to whatever store it fed before: a new (or
    restored) store used to resume from them and silently skip that history."""
    evs = [interaction(i, prefix="h") for i in range(30)]
    produce(kafka_bootstrap, topics["interactions"], [encode(e) for e in evs])
    # another store consumed everything under this group id and committed it to Kafka
    done = KafkaConsumer(bootstrap_servers=kafka_bootstrap, group_id=cfg.ingest.group_id, enable_auto_commit=False)
    parts = [TopicPartition(topics["interactions"], p) for p in done.partitions_for_topic(topics["interactions"])]
    done.assign(parts)
    done.seek_to_end(*parts)
    done.commit({tp: OffsetAndMetadata(done.position(tp), "", -1) for tp in parts})
    done.close()
    assert ingest_until_caught_up(cfg, engine).events == 30 and count(engine, interactions) == 30


def test_ingest_from_latest_takes_only_new_records(cfg, engine, topics, kafka_bootstrap):
    produce(kafka_bootstrap, topics["interactions"], [encode(interaction(i, prefix="old")) for i in range(10)])
    cfg.ingest.start = "latest"
    stop = threading.Event()
    stats: list = []
    thread = threading.Thread(target=lambda: stats.append(run_ingest(cfg, engine, stop)))
    thread.start()
    sent = iter(range(10_000))

    def send_new() -> int:
        # records sent before ingest has its partitions may be skipped too (they are older than
        # its start): keep sending a few until some arrive
        produce(kafka_bootstrap, topics["interactions"], [encode(interaction(next(sent), prefix="new"))])
        return count(engine, interactions)

    try:
        wait_for(send_new, 90, "new records to be stored", interval=0.5)
    finally:
        stop.set()
        thread.join(timeout=60)
    stored = ids(engine, interactions)
    assert stored and all(i.startswith("new-") for i in stored), stored


def test_tombstone_record_is_a_dead_letter(cfg, engine, topics, kafka_bootstrap):
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    producer.send(topics["feedback"], value=None, key=b"k")
    producer.flush()
    producer.close()
    stats = ingest_until_caught_up(cfg, engine)
    assert stats.dead_letters == 1 and table_counts(engine)["dead_letters"] == 1


@pytest.mark.parametrize("codec", ["gzip", "snappy", "lz4", "zstd"])
def test_compressed_batches_are_read(cfg, engine, topics, kafka_bootstrap, codec):
    evs = [interaction(i, prefix=codec, size=2000) for i in range(400)]
    produce(kafka_bootstrap, topics["interactions"], [encode(e) for e in evs], compression=codec)
    stats = ingest_until_caught_up(cfg, engine)
    assert stats.events == 400 and count(engine, interactions) == 400


def test_sigterm_flushes_commits_and_exits_cleanly(cfg_env, cfg, engine, topics, kafka_bootstrap):
    produce(kafka_bootstrap, topics["interactions"], [encode(interaction(i, prefix="t")) for i in range(3000)])
    env = dict(os.environ, **cfg_env, RTRL_INGEST__BATCH_MAX_RECORDS="100")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "ingest", "--no-progress"],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: count(engine, interactions) >= 500, timeout=120, what="500 rows")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "ingested" in out
    stored = count(engine, interactions)
    # what is stored and what the store says it has consumed agree exactly
    assert sum(stored_offsets(engine, cfg.ingest.group_id).values()) == stored


def test_status_shows_lag_per_partition_before_and_after_ingest(cfg_env, cfg, engine, topics, kafka_bootstrap):
    from click.testing import CliRunner

    from pipeline.cli import cli

    evs = [interaction(i, prefix="s") for i in range(90)]
    produce(
        kafka_bootstrap, topics["interactions"], [encode(e) for e in evs], keys=[e["request_id"].encode() for e in evs]
    )
    before = CliRunner().invoke(cli, ["status"], env=cfg_env)
    assert before.exit_code == 0, before.output
    assert "total lag 90" in before.output and f"{topics['interactions']}[0]" in before.output
    ingest_until_caught_up(cfg, engine)
    after = CliRunner().invoke(cli, ["status"], env=cfg_env)
    assert "total lag 0" in after.output and "interactions" in after.output


def test_rewards_from_a_store_filled_by_ingest(cfg_env, cfg, engine, topics, kafka_bootstrap):
    """The reward commands on what `rtrl ingest` stored from the real broker."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    inter = [interaction(i, prefix="w") for i in range(20)]
    feed = [fb(i, prefix="w", kind="accepted" if i % 2 else "rejected") for i in range(20)]
    produce(
        kafka_bootstrap,
        topics["interactions"],
        [encode(e) for e in inter],
        keys=[e["request_id"].encode() for e in inter],
    )
    produce(
        kafka_bootstrap, topics["feedback"], [encode(e) for e in feed], keys=[e["request_id"].encode() for e in feed]
    )
    ingest_until_caught_up(cfg, engine)
    run = CliRunner().invoke(cli, ["reward", "run"], env=cfg_env)
    assert run.exit_code == 0 and "20 rewards computed" in run.output and "mean +0.000" in run.output, run.output
    explain = CliRunner().invoke(cli, ["reward", "explain", "w-r-3"], env=cfg_env)
    assert "signal.accepted" in explain.output and "+0.5000" in explain.output, explain.output
    audit = CliRunner().invoke(cli, ["reward", "audit"], env=cfg_env)
    assert audit.exit_code == 0 and "50.0%" in audit.output, audit.output
