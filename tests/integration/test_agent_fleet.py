"""The agent fleet (pipeline/demo/agent_fleet.py) against `rtrl serve`, through the real broker:
every call of an episode is an interaction naming the episode and its step, a tool call is run
and its result sent back as the next call, an outcome names the episode, a broken call draws a
tool_error on its call -- and what the store says per version (episode_summaries) is what the
fleet saw. The model has learned the agent template's format only (always a call, then a copy):
the fleet's path, not the task, is under test."""

from __future__ import annotations

import os
import threading

import orjson
import pytest
from sqlalchemy import func, select

from deploy.serving.events import FEEDBACK_KEY, EventSender
from ingest.consumer import run_ingest
from pipeline.core.store.episodes import episode_summaries
from pipeline.core.store.tables import feedback, interactions
from pipeline.demo.agent import AGENT_TEMPLATE, TOOLS, call_text, draw_agent_task, messages_after_call
from pipeline.demo.agent_fleet import AgentFleet
from tests.support.helpers import wait_for
from tests.support.servers import ServeProcess

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="module")
def format_base(tmp_path_factory):
    from transformers import AutoTokenizer

    from train.models import init_tiny
    from train.warmup import warm_up

    out = tmp_path_factory.mktemp("agent-format") / "model"
    init_tiny(out, hidden=64, layers=2, heads=4, seed=0, tool_markers=True)  # the demo base's tokenizer
    (out / "chat_template.jinja").write_text(AGENT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(out)

    def sample(rng):
        task = draw_agent_task(rng)
        step1 = rng.random() < 0.5
        messages = [{"role": "user", "content": task.ask}] if step1 else messages_after_call(task)
        return (
            tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True),
            call_text() if step1 else task.word,
        )

    warm_up(out, sample, steps=150, batch=16, lr=1e-2, seed=0)
    return out


def test_the_agent_fleet_runs_episodes_through_serving_and_the_store_agrees(
    cfg, cfg_env, engine, format_base, tmp_path
):
    server = ServeProcess(format_base, {**os.environ, **cfg_env, "OMP_NUM_THREADS": "1"}, tmp_path / "serve.log")
    sender = EventSender(cfg.kafka_access, cfg.kafka.feedback_topic, key=FEEDBACK_KEY)
    try:
        wait_for(server.health, 120, "rtrl serve to start")
        fleet = AgentFleet(server.url, sender, rate=100.0, seed=3, delay_scale=0.0)
        stats = fleet.run(max_requests=40)
    finally:
        sender.close()
        server.stop()
    episodes, succeeded, errors, calls = stats.by_version["base"]
    assert stats.requests == calls >= 40 and stats.failed == 0
    assert calls > episodes, "no episode made a tool call and a follow-up"

    def stored():
        run_ingest(cfg, engine, threading.Event(), until_caught_up=True, idle_exit_s=60)
        with engine.connect() as conn:
            return (
                conn.scalar(select(func.count()).select_from(interactions)) >= calls
                and conn.scalar(select(func.count()).select_from(feedback)) >= stats.feedback
            )

    wait_for(stored, 120, "the episodes' calls and outcomes to be ingested")

    with engine.connect() as conn:
        bodies = [orjson.loads(b) for b in conn.scalars(select(interactions.c.body))]
        outcomes = conn.execute(select(feedback.c.kind, feedback.c.request_id, feedback.c.episode_id)).all()
    by_episode: dict[str, list[dict]] = {}
    for body in bodies:
        by_episode.setdefault(body["episode_id"], []).append(body)
    assert len(by_episode) == episodes
    for its in by_episode.values():
        its.sort(key=lambda b: b["step"])
        assert [b["step"] for b in its] == list(range(len(its)))
        for before, after in zip(its, its[1:]):  # a follow-up carries the call and the tool's result
            assert before["tool_calls"] and after["prompt"][-1]["role"] == "tool"
            assert after["prompt"][-2]["tool_calls"][0]["function"]["name"] == "read_selection"
    # outcomes name episodes; a broken call's error result names its call
    assert {k for k, r, e in outcomes if e is not None} <= {"accepted", "persisted", "rejected", "followup"}
    assert sum(k == "tool_error" and r is not None for k, r, e in outcomes) == errors
    assert sum(k == "accepted" for k, r, e in outcomes) == succeeded
    summaries = episode_summaries(engine)
    assert (
        len(summaries),
        sum(e.succeeded for e in summaries),
        sum(e.tool_errors for e in summaries),
        sum(e.calls for e in summaries),
    ) == (episodes, succeeded, errors, calls)
    assert {e.version for e in summaries} == {"base"}
