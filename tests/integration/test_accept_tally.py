"""The daemon's accept tally (SQLite and PostgreSQL): read after any interleaving of interactions
and feedback, it gives what served_and_accepted gives over the whole history, reading only what
is new."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete

from ingest.batch import decode_records
from pipeline.core.store import tables
from pipeline.core.store.accept_tally import AcceptTally
from pipeline.core.store.events import write_rows
from pipeline.core.store.online import served_and_accepted
from tests.support.factories import encode, interaction
from tests.support.factories import feedback as fb

_offsets = itertools.count()
_ids = itertools.count()


def store(engine, *events):
    write_rows(engine, decode_records([("t", 0, next(_offsets), encode(ev)) for ev in events], 1 << 20).rows)


@st.composite
def _event(draw):
    n, i = next(_ids), draw(st.integers(0, 7))
    what = draw(st.sampled_from(["call", "call", "again", "accept", "accept", "refuse", "other"]))
    if what in ("call", "again"):  # a second interaction for a request is served, and counted, too
        return interaction(
            i,
            prefix="t",
            policy_version=draw(st.sampled_from(["1", "2", "3"])),
            event_id=f"t-i-{i}" if what == "call" else f"t-again-{n}",
        )
    kind, value = {"accept": ("accepted", True), "refuse": ("accepted", False), "other": ("persisted", True)}[what]
    return fb(i, prefix="t", kind=kind, value=value, event_id=f"t-f-{n}")


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(batches=st.lists(st.lists(_event(), min_size=1, max_size=5), min_size=1, max_size=8))
def test_the_tally_gives_what_the_whole_history_query_gives(engine, batches):
    with engine.begin() as conn:
        for table in (tables.feedback, tables.interactions):
            conn.execute(delete(table))
    tally = AcceptTally()
    for events in batches:
        store(engine, *events)
        assert tally.read(engine) == served_and_accepted(engine)
        assert tally.read(engine, ["2"]) == served_and_accepted(engine, ["2"])


def test_a_read_with_nothing_new_costs_no_query_over_the_history(engine):
    store(engine, *[ev for i in range(30) for ev in (interaction(i, prefix="q"), fb(i, prefix="q"))])
    tally = AcceptTally()
    assert tally.read(engine) == {"1": (30, 30)}
    statements: list[str] = []

    from sqlalchemy import event

    def seen(conn, cursor, statement, *args):
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", seen)
    try:
        store(engine, interaction(30, prefix="q"), fb(3, prefix="q", kind="accepted", event_id="q-again"))
        statements.clear()
        assert tally.read(engine) == {"1": (31, 30)}
    finally:
        event.remove(engine, "before_cursor_execute", seen)
    # every read of interactions is bounded by the watermarks (an id range), none is a scan
    reads = [s for s in statements if "FROM interactions" in s]
    assert reads and all("interactions.id >" in s or "interactions.id <=" in s or "max(" in s for s in reads)


def test_an_accept_committed_after_the_watermarks_were_read_counts_once(engine, monkeypatch):
    """Feedback that commits between the read of the watermarks and the tally's queries is past
    the feedback watermark: the next read counts it, and only that one."""
    import pipeline.core.store.accept_tally as accept_tally

    real = accept_tally.safe_tops
    tally = AcceptTally()
    tally.read(engine)
    store(engine, interaction(50, prefix="w"))

    def tops_then_an_accept(engine_):
        tops = real(engine_)
        store(engine, fb(50, prefix="w", kind="accepted"))
        return tops

    monkeypatch.setattr(accept_tally, "safe_tops", tops_then_an_accept)
    assert tally.read(engine) == {"1": (1, 0)}  # as of the watermarks: served, not yet accepted
    monkeypatch.setattr(accept_tally, "safe_tops", real)
    assert tally.read(engine) == served_and_accepted(engine) == {"1": (1, 1)}
