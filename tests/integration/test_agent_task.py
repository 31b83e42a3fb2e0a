"""The store's per-episode and tool-error queries for the agent task, on both stores."""

from __future__ import annotations

from datetime import timedelta

from pipeline.core.store.episodes import episode_summaries
from pipeline.core.store.online import tool_call_errors
from pipeline.demo.agent import (
    call_text,
)
from tests.support.factories import BASE_TS, feedback, interaction
from tests.support.stores import store


def test_episodes_and_tool_errors_per_version_from_the_store(engine):
    calls = [  # (request, episode, step, version, completion, tool_calls)
        (
            "a1",
            "ep-a",
            0,
            "base",
            call_text(),
            [{"id": "c0", "type": "function", "function": {"name": "read_selection", "arguments": "{}"}}],
        ),
        ("a2", "ep-a", 1, "1", "dcba", None),  # an episode belongs to the version of its first call
        (
            "b1",
            "ep-b",
            0,
            "base",
            "<tool_call>{oops",
            [{"id": "c0", "type": "function", "function": {"name": "", "arguments": "{oops"}, "error": "not JSON"}],
        ),
        ("c1", "ep-c", 0, "1", "abcd", None),
    ]
    events = [
        interaction(
            i,
            request_id=rid,
            episode_id=ep,
            step=step,
            policy_version=v,
            completion=text,
            **({"tool_calls": tc} if tc else {}),
        )
        for i, (rid, ep, step, v, text, tc) in enumerate(calls)
    ]
    store(
        engine,
        *events,
        feedback(10, request_id=None, episode_id="ep-a", kind="accepted", value=True),
        feedback(11, request_id=None, episode_id="ep-c", kind="accepted", value=False),
    )
    summaries = {e.episode_id: e for e in episode_summaries(engine)}
    assert {k: (e.version, e.calls, e.tool_errors, e.succeeded) for k, e in summaries.items()} == {
        "ep-a": ("base", 2, 0, True),
        "ep-b": ("base", 1, 1, False),
        "ep-c": ("1", 1, 0, False),
    }
    since = BASE_TS - timedelta(seconds=1)
    assert tool_call_errors(engine, ["base", "1"], since) == {"base": (2, 1), "1": (2, 0)}
    assert tool_call_errors(engine, ["1"], since, until=BASE_TS + timedelta(seconds=1.5)) == {"1": (1, 0)}
