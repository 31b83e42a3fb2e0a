"""Contract-valid events with hostile content, through every stage: ingest's decode-and-store
(SQLite and PostgreSQL), a reward run, training's selection and tokenization (a dry run: no
optimizer step), and the gate's evaluation of a candidate against the base model.

Hostile: NUL and other control characters, escaped lone surrogates, megabyte strings, deep
nesting, numbers at the float limits, odd `sampling` and `metadata` values, served token ids
outside the vocabulary. No stage may raise or halt; whatever a stage cannot use is counted
with its reason, and everything else is used: the counts add up at every stage.

(The real broker's path into the same decode-and-store is tested with a poison record in
tests/integration/test_ingest_kafka.py; here hypothesis drives the content, many batches per test.)
"""

from __future__ import annotations

import json
import os
import uuid
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from deploy.evaluate import EvalJob, evaluate
from deploy.stage import eval_episodes
from ingest.batch import decode_records
from pipeline.core.config import GateConfig, TrainConfig
from pipeline.core.store.events import write_rows
from pipeline.core.store.tables import dead_letters, interactions, rewards
from reward.spec import load_spec
from reward.stage import run_rewards
from tests.support.factories import BASE_TS, feedback, interaction
from train.data import DataStats
from train.inference import PolicySet
from train.run import TrainReport
from train.selection import select as select_episodes
from train.selection import tokenize_selection

SPEC = load_spec()
LATER = BASE_TS.replace(tzinfo=None) + timedelta(days=30)
MAX_BYTES = 1 << 20

hostile_text = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8"), max_size=40),  # NUL and control characters included
    st.text(alphabet=st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=2),
    st.text(alphabet=st.sampled_from("\x00\x01\x1b\x7f\u2028\ufeff\U0001f600ab>"), max_size=40),
    st.integers(0, 3).map(lambda k: "x" * (MAX_BYTES // 2 + k * MAX_BYTES // 3)),  # up to over the limit
)
floats = st.sampled_from([0.0, -0.0, 5e-324, 1.7976931348623157e308, -1.7976931348623157e308, 1e-300, 2.5])
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), floats, hostile_text)


DEEP = "__deep_%d__"  # stands for metadata nested that deep: written as text (json.dumps would recurse)


def deep_json(depth: int) -> str:
    return '{"d":[' * depth + '{"leaf":"x"}' + "]}" * depth


metadata = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=8), json_leaf, max_size=4),
    st.integers(1, 1500).map(lambda d: DEEP % d),  # past orjson's 1024: a dead letter
    st.fixed_dictionaries({"expects_attempt": st.one_of(st.booleans(), json_leaf)}),
)
sampling = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "temperature": st.one_of(floats, st.text(max_size=4), st.integers(-3, 3), st.lists(floats, max_size=2)),
            "top_p": st.one_of(floats, st.lists(floats, max_size=2), st.just(0.9)),
            "top_k": st.one_of(st.integers(-(2**63), 2**63 - 1), floats),
            "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
            "min_p": json_leaf,
        },
    ),
)
token_ids = st.one_of(
    st.none(),
    st.lists(st.integers(-(2**62), 2**62), min_size=1, max_size=4),
    st.lists(st.integers(0, 90), min_size=1, max_size=4),
)
prompt = st.one_of(
    hostile_text,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "\x00"]),
                "content": st.one_of(hostile_text, json_leaf),
            }
        ),
        min_size=1,
        max_size=3,
    ),
)
completion = st.one_of(
    hostile_text,
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["assistant", "tool", "user"]), "content": st.one_of(hostile_text, json_leaf)},
            optional={"tool_calls": st.lists(st.dictionaries(st.text(max_size=6), json_leaf, max_size=2), max_size=2)},
        ),
        max_size=3,
    ),
)


@st.composite
def episode(draw, i: int, prefix: str) -> list[bytes]:
    ids = draw(token_ids)
    ev = interaction(
        i,
        prefix=prefix,
        prompt=draw(prompt),
        completion=draw(completion),
        completion_token_ids=ids,
        behavior_logprobs=None if ids is None else draw(st.lists(floats, min_size=len(ids), max_size=len(ids))),
        sampling=draw(sampling),
        metadata=draw(metadata),
        latency_ms=draw(floats.filter(lambda f: f >= 0)),
    )
    kind = draw(st.sampled_from(["accepted", "persisted", "rejected", "thumbs", "x\x00"]))
    fb = feedback(
        i,
        prefix=prefix,
        kind=kind,
        value=draw(st.one_of(st.booleans(), floats)),
        payload=draw(st.one_of(st.none(), hostile_text)),
    )
    # ensure_ascii: lone surrogates become \\ud800 escapes (a dead letter), as a Python producer sends them
    out = [json.dumps(e, ensure_ascii=draw(st.booleans())) for e in (ev, fb)]
    meta = ev["metadata"]
    if isinstance(meta, str) and meta.startswith("__deep_"):
        out[0] = out[0].replace(json.dumps(meta), deep_json(int(meta.strip("_").split("_")[1])))
    return [text.encode("utf-8", "surrogatepass") for text in out]


@pytest.fixture(scope="module")
def policies(reverse_base, tmp_path_factory):
    from tests.support.adapters import make_adapter

    runner = PolicySet.load(reverse_base, device="cpu")
    runner.add("cand", make_adapter(reverse_base, tmp_path_factory.mktemp("hostile") / "adapter", seed=5))
    return runner


# the suite runs a fixed set of 10 per backend (CI must not fail on a draw); RTRL_HOSTILE_EXAMPLES=N
# explores N random ones (80 per backend passed on 2026-12-02)
EXPLORE = int(os.environ.get("RTRL_HOSTILE_EXAMPLES", "0"))


@settings(
    max_examples=EXPLORE or 10,
    deadline=None,
    derandomize=not EXPLORE,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.data_too_large, HealthCheck.too_slow],
)
@given(data=st.data())
def test_hostile_events_pass_every_stage_counted(engine, reverse_base, policies, data):
    prefix = f"h{uuid.uuid4().hex[:8]}"
    records = [r for i in range(data.draw(st.integers(4, 10))) for r in data.draw(episode(i, prefix))]
    with engine.connect() as conn:
        before = {t.name: conn.scalar(select(func.count()).select_from(t)) for t in (interactions, dead_letters)}

    # ingest: decode and store in one transaction, as a lane does; nothing raises, all accounted for
    batch = decode_records([(prefix, 0, k, r) for k, r in enumerate(records)], MAX_BYTES)  # (source: this example)
    result = write_rows(engine, batch.rows)
    assert result.events + result.duplicates + result.dead_letters == len(records)
    with engine.connect() as conn:
        after = {t.name: conn.scalar(select(func.count()).select_from(t)) for t in (interactions, dead_letters)}
    assert after["dead_letters"] - before["dead_letters"] == sum(batch.dead_by_reason.values())
    for reason in batch.dead_by_reason:  # what the examples exercised (--hypothesis-show-statistics)
        event(f"dead letter: {reason}")

    # rewards: every stored episode is read; nothing raises
    with engine.connect() as conn:
        earlier = conn.scalar(select(func.coalesce(func.max(rewards.c.id), 0)))
    report = run_rewards(engine, SPEC, now=LATER)
    assert report.episodes == after["interactions"]

    # training's selection and tokenization: each episode trained on or skipped with a reason
    # (a CPU test: longer episodes are skipped as too long, as they would be past a real limit)
    cfg = TrainConfig(
        base_model=reverse_base, max_seq_len=256, batch_tokens=1024, holdout_percent=0.0, staleness_s=None
    )
    # this example's episodes: with every earlier example's too, an exploratory run of many
    # examples grew quadratically and ran into pytest's timeout (a hypothesis "flaky failure")
    selection = select_episodes(engine, cfg, SPEC.version, None, now=LATER, since=earlier)
    train_report = TrainReport(None, selection.counts, selection.watermark_from, selection.watermark_to, DataStats())
    episodes, _, _ = tokenize_selection(policies.tokenizer, selection, cfg, train_report)
    accounted = (
        len(episodes) + sum(train_report.data.skipped.values()) + train_report.too_long + train_report.unreadable
    )
    assert accounted == len(selection.rows)
    for reason in train_report.data.skipped:
        event(f"training skip: {reason}")
    if episodes:
        event("trained on some")

    # the gate's evaluation: every held-out episode evaluated or excluded with a reason
    gate = GateConfig(eval_episodes=50, generate_prompts=8, max_new_tokens=2, min_ess=1)
    held, unusable = eval_episodes(engine, SPEC.version, cfg.model_copy(update={"holdout_percent": 100.0}), gate)
    evaluation = evaluate(
        EvalJob(policies, "cand", None, held, gate, generate_prompts=8, max_new_tokens=2, max_seq_len=cfg.max_seq_len)
    )
    evaluation.excluded.update(unusable)
    assert evaluation.candidate.smoke_ok and evaluation.champion.smoke_ok, evaluation.candidate.smoke_error
    assert evaluation.episodes + sum(evaluation.excluded.values()) == len(held) + unusable["unusable_events"]
    for reason, n in evaluation.excluded.items():
        if n:
            event(f"gate exclusion: {reason}")
