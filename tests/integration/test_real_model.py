"""A realistic model through every stage: a Qwen2-architecture model with a 32k byte-level BPE and
a ChatML chat template, served by `rtrl serve` to the official `openai` client (system + user
turns, and conversations with a tool turn; temperature 0.7, top-p 0.9), events through the
real broker into the store, rewarded by the users' outcomes, one cycle (reward, train, gate,
promotion), and `rtrl serve` answering with the new version.

Checked on the way: the served tokens' behaviour log-probs are what training recomputes for
them (the on-policy ratio, top-p included), and the promoted adapter moved the log-probs of
what was served in the rewarded direction."""

from __future__ import annotations

import os
import threading
import uuid
from collections import defaultdict
from datetime import UTC, datetime

import openai
import orjson
import pytest
import torch
from sqlalchemy import func, select

from deploy.registry import CHAMPION
from ingest.consumer import run_ingest
from pipeline.core.config import Config
from pipeline.core.store.tables import feedback as feedback_table
from pipeline.core.store.tables import interactions, training_episodes
from pipeline.core.store.training import is_held_out
from pipeline.core.types import LoggedEpisode, prompt_key, sampling_params
from pipeline.cycle import default_deps, run_cycle
from pipeline.kafka_local import ensure_topics
from reward.spec import load_spec
from tests.support.factories import feedback
from tests.support.helpers import wait_for
from tests.support.kafka_events import produce_events
from tests.support.servers import ServeProcess
from train.batches import collate
from train.data import tokenize_episode
from train.inference import PolicySet
from train.logprobs import token_logprobs
from train.models import load_policy
from train.sampling import SamplingRows

pytestmark = pytest.mark.kafka

SYSTEM = {"role": "system", "content": "You are a terse assistant."}


def conversations(n: int) -> list[list[dict]]:
    """Chat requests: a system and a user turn, and every third one a conversation in which the
    assistant already looked something up (its turn, then the tool's result)."""
    out = []
    for i in range(n):
        ask = {"role": "user", "content": f"task {i}: rename file_{i % 7}.py"}
        if i % 3 == 2:
            out.append(
                [
                    SYSTEM,
                    ask,
                    {"role": "assistant", "content": "Looking it up."},
                    {"role": "tool", "tool_call_id": f"c{i}", "content": f"file_{i % 7}.py exists"},
                ]
            )
        else:
            out.append([SYSTEM, ask])
    return out


def good(token_ids: list[int], text: str) -> bool:
    """What the simulated users keep: answers with some text whose first token has an even id
    (an empty answer is never kept: rewarding one teaches the candidate to stop at once, and the
    gate's abstention canary rightly refuses it)."""
    return bool(text.strip()) and token_ids[0] % 2 == 0


# On SQLite only: what this test is about is the model (tokenizer, template, log-probs); the
# same cycle on PostgreSQL is test_cycle.py's, and a second run here cost 90 s of the suite
@pytest.mark.parametrize("empty_db_url", ["sqlite"], indirect=True)
def test_bpe_model_served_trained_gated_promoted_and_served_again(
    cfg, cfg_env, engine, bpe_base, topics, kafka_bootstrap, tmp_path
):
    updates = f"t-{uuid.uuid4().hex[:8]}.model-updates"
    ensure_topics(kafka_bootstrap, [updates], partitions=1)
    tracking, name = f"sqlite:///{tmp_path / 'mlflow.db'}", f"bpe-{uuid.uuid4().hex[:6]}"
    env = {
        **os.environ,
        **cfg_env,
        "RTRL_MLFLOW__TRACKING_URI": tracking,
        "RTRL_MLFLOW__REGISTERED_MODEL": name,
        "RTRL_KAFKA__MODEL_UPDATES_TOPIC": updates,
        "OMP_NUM_THREADS": "1",
    }
    server = ServeProcess(bpe_base, env, tmp_path / "serve.log")
    url, health = server.url, server.health

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)

    def ask(messages: list[dict], seed: int):
        raw = client.chat.completions.with_raw_response.create(
            model="policy", messages=messages, temperature=0.7, top_p=0.9, max_tokens=6, seed=seed
        )
        return raw.headers["X-Rtrl-Policy-Version"], raw.parse()

    try:
        wait_for(health, 120, "rtrl serve to start")
        served = {}  # request id -> (served token ids, text)
        for i, messages in enumerate(conversations(60) * 2):
            version, answer = ask(messages, seed=i)
            assert version == "base" and answer.choices[0].message.role == "assistant"
            served[answer.id] = (
                [c.token_id for c in answer.choices[0].logprobs.content],
                answer.choices[0].message.content or "",
            )
        # the users' outcomes, a while after serving: kept or reverted (terminal: rewarded at once)
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        outcomes = [
            feedback(
                i, prefix="bpe", request_id=rid, event_id=f"bpe-f-{i}", kind="persisted", value=good(*answer), ts=now
            )
            for i, (rid, answer) in enumerate(served.items())
        ]
        produce_events(kafka_bootstrap, topics, outcomes)

        def stored():  # serving's events and the outcomes, through the real broker: both, since
            # ingest may stop before it has read every partition, and a cycle run on part of
            # the outcomes trains on part of the prompts (the others then move only by chance)
            run_ingest(cfg, engine, threading.Event(), until_caught_up=True, idle_exit_s=60)
            with engine.connect() as conn:
                return conn.scalar(select(func.count()).select_from(interactions)) >= len(served) and conn.scalar(
                    select(func.count()).select_from(feedback_table)
                ) >= len(outcomes)

        wait_for(stored, 120, "serving's events and the outcomes to be ingested")

        # 1. on-policy: what training recomputes for the served tokens is what serving reported
        base = load_policy(bpe_base, device="cpu")
        with engine.connect() as conn:
            bodies = [orjson.loads(b) for b in conn.scalars(select(interactions.c.body))]
        episodes = []
        for ev in bodies:
            ep = tokenize_episode(
                base.tokenizer,
                ev["request_id"],
                ev["prompt"],
                ev["completion"],
                ev["completion_token_ids"],
                ev["behavior_logprobs"],
            )
            ep.sample_with(sampling_params(ev["sampling"]))
            episodes.append(ep)
        assert {e.top_p for e in episodes} == {0.9} and all(e.behavior_note == "served_ids" for e in episodes)
        batch = collate(episodes, list(range(len(episodes))), base.tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            recomputed = token_logprobs(base.model, batch, SamplingRows.of(episodes))[0]
        mask = batch.mask.bool()
        assert float((recomputed - batch.behavior)[mask].abs().mean()) < 1e-3

        # 2. one cycle: rewards, training from the served tokens, the gate, the promotion
        config = Config.model_validate(
            {
                **cfg.model_dump(),
                "state_dir": tmp_path / "state",
                "mlflow": {"tracking_uri": tracking, "registered_model": name},
                "kafka": {**cfg.kafka.model_dump(), "model_updates_topic": updates},
                # ~26 small steps, not 8 large ones: Adam's few near-sign steps at lr 1e-2 moved the
                # rewarded way in as few as 12 of 21 groups, depending on the order the broker delivered
                # the episodes in and on the seed (docs/benchmarks.md, "twenty-fifth session")
                "train": {
                    "base_model": bpe_base,
                    "learning_rate": 3e-3,
                    "epochs": 2,
                    "batch_tokens": 512,
                    "max_seq_len": 256,
                    "lora_r": 8,
                    "lora_alpha": 16,
                    "holdout_percent": 20.0,
                },
                # the mechanics are under test, not the bounds: a random model learns a parity rule on
                # unseen prompts only by chance (see test_cycle), and at this learning rate its greedy
                # 4-token answers to them may collapse to nothing -- or start with "{" or the BPE's
                # <tool_call> token, which the tool-format canary counts as a broken call: one of the
                # 10 answers is a 0.1 increase over a limit of 0.02 (the likely cause of a failure
                # seen once in eleven runs) -- the canaries that catch those in earnest are tested in
                # test_gate, test_deploy_registry and test_agent_task
                "gate": {
                    "max_new_tokens": 4,
                    "min_ess": 2,
                    "generate_prompts": 10,
                    "max_kl": 50.0,
                    "min_improvement": -1.0,
                    "bounds": {
                        "smoke_latency_ms": {"max_rel_increase": 50.0},
                        "mean_length": {"max_rel_increase": 50.0},
                        "abstention_rate": {"max": 1.0, "max_increase": 1.0},
                        "repetition_rate": {"max": 1.0, "max_increase": 1.0},
                        "tool_format_error_rate": {"max": 1.0, "max_increase": 1.0},
                    },
                },
                "cycle": {"min_new_episodes": 20},
            }
        )
        deps = default_deps(config, engine, load_spec())
        row = run_cycle(deps)
        assert row.state == "done" and row.promoted == 1, row.reason
        champion = deps.registry.alias(CHAMPION).version
        wait_for(lambda: health()["version"] == champion, 120, "serving to follow the promotion")
        version, answer = ask(conversations(1)[0], seed=999)
        assert version == champion and answer.choices[0].message.content is not None

        # 3. the promoted adapter moved what was served in the rewarded direction: within each
        # prompt of the training split answered both well and badly (the groups that carry an
        # advantage), the kept answer's log-prob rose against the reverted one's. Held-out
        # prompts and one-sided groups move only by generalisation, a random model's noise.
        policies = PolicySet.load(bpe_base, device="cpu")
        policies.add("new", deps.registry.download(deps.registry.get(champion).source, tmp_path / "champion"))
        logged = [
            LoggedEpisode(
                ev["request_id"], ev["prompt"], ev["completion"], ev["completion_token_ids"], None, 0.7, 0.0, 0.9, 0
            )
            for ev in bodies
        ]
        before, after = policies.sequence_logprobs(None, logged), policies.sequence_logprobs("new", logged)
        groups: dict[bytes, dict[bool, list[float]]] = defaultdict(lambda: {True: [], False: []})
        for ev, b, a in zip(bodies, before, after):
            if not is_held_out(ev["request_id"], orjson.dumps(ev), 20.0):
                groups[prompt_key(ev["prompt"])][good(ev["completion_token_ids"], ev["completion"])].append(a - b)
        with engine.connect() as conn:  # every training-split episode trained (the margins assume it)
            trained = set(conn.scalars(select(training_episodes.c.request_id)))
        assert trained == {
            ev["request_id"] for ev in bodies if not is_held_out(ev["request_id"], orjson.dumps(ev), 20.0)
        }
        margins = [
            sum(g[True]) / len(g[True]) - sum(g[False]) / len(g[False]) for g in groups.values() if g[True] and g[False]
        ]
        assert len(margins) >= 8, margins
        assert sum(m > 0 for m in margins) >= 0.7 * len(margins) and sum(margins) > 0, margins
    finally:
        server.stop()
