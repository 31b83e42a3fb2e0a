"""`rtrl serve` (a real process) under concurrent requests while three promotions and a staged
canary happen, and the vLLM hook against a local server that implements vLLM's two adapter
endpoints."""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import pytest
import requests
from kafka import KafkaConsumer

from deploy.registry import Registry
from deploy.serving.events import ModelUpdatePublisher
from deploy.serving.follow import Follower, current
from deploy.serving.routing import routes_to_canary, routing_salt
from deploy.serving.vllm import VllmAdapterSync
from deploy.tracking import MlflowTracker
from pipeline.core.store import db as store_db
from pipeline.core.store.deploys import record_decision
from pipeline.core.types import LoggedEpisode, ModelUpdate
from pipeline.kafka_local import ensure_topics
from tests.support.adapters import make_adapter
from tests.support.helpers import wait_for
from tests.support.servers import InProcessServer, ServeProcess
from tests.support.vllm_stub import VllmStub
from train.inference import PolicySet


@pytest.fixture
def registered(tmp_path, reverse_base, kafka_bootstrap):
    """Two registered versions, the store, the topics, and a registry that publishes moves."""
    url = f"sqlite:///{tmp_path / 'rtrl.db'}"
    store_db.upgrade(url)
    engine = store_db.make_engine(url)
    tracking = f"sqlite:///{tmp_path / 'mlflow.db'}"
    topics = {k: f"t-{uuid.uuid4().hex[:8]}.{k}" for k in ("updates", "interactions")}
    ensure_topics(kafka_bootstrap, list(topics.values()), partitions=1)
    name = f"policy-{uuid.uuid4().hex[:6]}"
    publisher = ModelUpdatePublisher(kafka_bootstrap, topics["updates"])
    registry = Registry(tracking, name, engine, publisher)
    dirs = {}
    for seed in (1, 2):
        adapter = make_adapter(reverse_base, tmp_path / f"adapter-{seed}", seed)
        tracker = MlflowTracker(tracking, "serve-test", tmp_path / "artifacts")
        tracker.log_artifacts(adapter, "adapter")
        tracker.end("FINISHED")
        version = registry.register(tracker.run_id, {"base_model": str(reverse_base)}).version
        dirs[version] = adapter
    yield {"registry": registry, "tracking": tracking, "topics": topics, "name": name, "dirs": dirs, "url": url}
    publisher.close()
    engine.dispose()


def test_serve_follows_three_promotions_under_concurrent_requests(registered, reverse_base, tmp_path, kafka_bootstrap):
    r = registered
    registry = r["registry"]
    registry.promote("1", actor="test", reason="start", force=True)
    env = {
        **os.environ,
        "RTRL_STATE_DIR": str(tmp_path / "state"),
        "RTRL_DB_URL": r["url"],
        "RTRL_MLFLOW__TRACKING_URI": r["tracking"],
        "RTRL_MLFLOW__REGISTERED_MODEL": r["name"],
        "RTRL_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "RTRL_KAFKA__MODEL_UPDATES_TOPIC": r["topics"]["updates"],
        "RTRL_KAFKA__INTERACTIONS_TOPIC": r["topics"]["interactions"],
        "RTRL_ROUTING_SECRET": "s3cret-salt",
    }
    server = ServeProcess(reverse_base, env, tmp_path / "serve.log")
    base_url, health = server.url, server.health
    salt = routing_salt("s3cret-salt", "1")  # the canary's hash, as the server salts it
    try:
        assert wait_for(health, 120, "rtrl serve to start")["version"] == "1"
        results, failures, stop = [], [], threading.Event()

        def client(k: int) -> None:
            i = 0
            while not stop.is_set():
                prompt = "abcdef"[k] + "abcdef"[i % 6] + "abcdef"[(i + k) % 6] + ">"
                rid = f"c{k}-{i}"
                try:
                    resp = requests.post(
                        f"{base_url}/v1/completions",
                        headers={"X-Request-Id": rid},
                        timeout=30,
                        json={"prompt": prompt, "max_tokens": 3, "temperature": 1.0, "seed": i},
                    )
                    if resp.status_code == 200:  # the server chose the request's id; ours is kept beside it
                        assert resp.headers["X-Request-Id"] == resp.json()["id"] != rid
                        results.append((resp.json()["id"], prompt, resp))
                    else:
                        failures.append((rid, prompt, resp))
                except requests.RequestException as exc:
                    failures.append((rid, prompt, exc))
                i += 1

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for target in ("2", "1", "2"):  # promote, roll back, promote
            wait_for(lambda: len(results) >= 10, 60, "requests on the current version")
            done = len(results)
            if target == "1":
                registry.rollback(actor="test", reason="back")
            else:
                registry.promote(target, actor="test", reason="next", force=True)
            wait_for(lambda: health()["version"] == target, 60, f"the server to serve v{target}")
            wait_for(lambda: len(results) >= done + 10, 60, "requests on the new version")
        # a staged rollout: v1 as the canary answers the requests whose id hashes below its share
        record_decision(registry.engine, r["name"], "1", "2", None, True, {"decision": {"checks": []}})
        registry.stage("1", 0.5, actor="test", reason="canary")
        wait_for(lambda: health().get("canary") == {"version": "1", "share": 0.5}, 60, "the canary to be staged")
        staged = len(results)
        wait_for(lambda: len(results) >= staged + 24, 60, "requests during the canary")
        canary_window = results[staged + 4 : staged + 24]  # past the (at most 4) requests in flight at the move

        # an agent's episode goes to one version, whatever its calls' request ids hash to
        def versions_of(episode: str) -> set[str]:
            return {
                requests.post(
                    f"{base_url}/v1/completions",
                    headers={"X-Rtrl-Episode-Id": episode},
                    json={"prompt": "ab>", "max_tokens": 2},
                ).headers["X-Rtrl-Policy-Version"]
                for _ in range(4)
            }

        sticky = {f"ep-sticky-{k}": versions_of(f"ep-sticky-{k}") for k in range(8)}
        registry.unstage(actor="test", reason="withdrawn")
        wait_for(lambda: "canary" not in health(), 60, "the canary to be withdrawn")
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert not failures, failures[:3]
        versions = [resp.headers["X-Rtrl-Policy-Version"] for _, _, resp in results]
        assert {"1", "2"} <= set(versions) and len(results) >= 40

        # every response's log-probs are those of the adapter it names (and not the other's)
        policies = PolicySet.load(reverse_base, device="cpu")
        for v, d in r["dirs"].items():
            policies.add(v, d)
        by_version: dict[str, list] = {"1": [], "2": []}
        for rid, prompt, resp in results:
            choice = resp.json()["choices"][0]
            ids = choice["logprobs"]["token_ids"]
            if choice["finish_reason"] == "stop":  # stopping is an action: its token is logged, its text is not
                assert (
                    ids[-1] == policies.tokenizer.eos_token_id and policies.tokenizer.decode(ids[:-1]) == choice["text"]
                )
            if ids:
                by_version[resp.headers["X-Rtrl-Policy-Version"]].append(
                    (LoggedEpisode(rid, prompt, choice["text"], ids), sum(choice["logprobs"]["token_logprobs"]))
                )
        for v, items in by_version.items():
            other = "2" if v == "1" else "1"
            mine = policies.sequence_logprobs(v, [e for e, _ in items])
            theirs = policies.sequence_logprobs(other, [e for e, _ in items])
            assert all(abs(m - s) < 1e-3 for m, (_, s) in zip(mine, items)), v
            assert sum(abs(t - s) > 1e-3 for t, (_, s) in zip(theirs, items)) > 0.9 * len(items)
            # the gate's one-pass comparison: the same log-probs, and a KL that tells the two apart
            mine2, theirs2, kl = policies.compare(v, other, [e for e, _ in items])
            assert all(abs(a - b) < 1e-4 for a, b in zip(mine + theirs, mine2 + theirs2)) and kl > 1e-3

        # every request became an interaction event naming the version that served it
        consumer = KafkaConsumer(
            r["topics"]["interactions"],
            bootstrap_servers=kafka_bootstrap,
            auto_offset_reset="earliest",
            group_id=None,
            consumer_timeout_ms=2000,
        )
        events = {}
        deadline = time.monotonic() + 30
        while len(events) < len(results) + len(failures) and time.monotonic() < deadline:
            for rec in consumer:
                ev = json.loads(rec.value)
                events[ev["request_id"]] = ev
        consumer.close()
        assert {ev["client_request_id"] for ev in events.values() if "client_request_id" in ev} >= {"c0-0", "c1-0"}
        for rid, _, resp in results:
            assert events[rid]["policy_version"] == resp.headers["X-Rtrl-Policy-Version"]
            assert events[rid]["behavior_logprobs"] == resp.json()["choices"][0]["logprobs"]["token_logprobs"]

        bad = requests.post(f"{base_url}/v1/completions", json={"prompt": "ab>", "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        chat = requests.post(
            f"{base_url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "ab"}], "max_tokens": 2}
        )
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant"
        assert [resp.headers["X-Rtrl-Policy-Version"] for rid, _, resp in canary_window] == [
            "1" if routes_to_canary(rid, 0.5, salt) else "2" for rid, _, _ in canary_window
        ]
        assert {resp.headers["X-Rtrl-Policy-Version"] for _, _, resp in canary_window} == {"1", "2"}
        assert sticky == {ep: {"1" if routes_to_canary(ep, 0.5, salt) else "2"} for ep in sticky}
        assert set().union(*sticky.values()) == {"1", "2"}
        metrics = requests.get(f"{base_url}/metrics").text
        assert "rtrl_serve_swaps_total 4.0" in metrics and "rtrl_serve_canary_share 0.0" in metrics  # start + 3
    finally:
        server.stop()


def test_vllm_hook_loads_the_new_adapter_then_unloads_the_old(registered, tmp_path, kafka_bootstrap):
    r = registered
    vllm = VllmStub(base=r["name"])
    upstream = InProcessServer(vllm.app)
    sync = VllmAdapterSync(upstream.url, r["name"], r["registry"].download, tmp_path / "dl", grace_s=0.2)
    follower = Follower(
        kafka_bootstrap,
        r["topics"]["updates"],
        r["name"],
        sync.on_update,
        lambda alias: current(r["registry"], alias),
        aliases=("champion", "canary"),
    ).start()
    calls = vllm.lora_calls
    try:
        r["registry"].promote("1", actor="test", reason="first", force=True)
        wait_for(lambda: len(calls) >= 1, 30, "vLLM to load v1")
        r["registry"].promote("2", actor="test", reason="second", force=True)
        wait_for(lambda: len(calls) >= 3, 30, "vLLM to load v2 and unload v1")
        # a staged rollout: v1 as the canary is loaded next to v2, withdrawn (unloaded), staged
        # again and promoted (v2 unloaded; v1 is loaded already)
        record_decision(r["registry"].engine, r["name"], "1", "2", None, True, {"decision": {"checks": []}})
        r["registry"].stage("1", 0.1, actor="test", reason="canary")
        wait_for(lambda: len(calls) >= 4, 30, "vLLM to load the canary")
        r["registry"].unstage(actor="test", reason="withdrawn")
        wait_for(lambda: len(calls) >= 5, 30, "vLLM to unload the canary")
        r["registry"].stage("1", 0.1, actor="test", reason="canary")
        r["registry"].promote("1", actor="test", reason="canary passed")
        wait_for(lambda: len(calls) >= 7, 30, "vLLM to unload v2")
        name = r["name"]
        load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
        assert calls == [
            (load, f"{name}-v1", 200),
            (load, f"{name}-v2", 200),
            (unload, f"{name}-v1", 200),
            (load, f"{name}-v1", 200),
            (unload, f"{name}-v1", 200),
            (load, f"{name}-v1", 200),
            (unload, f"{name}-v2", 200),
        ]
        assert sync.current == f"{name}-v1" and sync.canary is None and set(vllm.loras) == {f"{name}-v1"}
        # a sync started again while vLLM holds the champion picks up where vLLM is: no load of a
        # loaded name (vLLM refuses it with a 400), nothing unloaded
        again = VllmAdapterSync(upstream.url, r["name"], r["registry"].download, tmp_path / "dl2")
        again.on_update(current(r["registry"], "champion"))
        assert again.current == f"{name}-v1" and len(calls) == 7
    finally:
        follower.close()
        upstream.stop()


def test_a_failed_adapter_load_is_tried_again_until_vllm_serves_it(registered, tmp_path, kafka_bootstrap):
    """vLLM refuses the load (an engine error, 500) twice: the follower tries the update again,
    backing off, and the champion is loaded on the third try -- not at the next registry move."""
    r = registered
    vllm = VllmStub(base=r["name"])
    vllm.fail_loads = 2
    upstream = InProcessServer(vllm.app)
    sync = VllmAdapterSync(upstream.url, r["name"], r["registry"].download, tmp_path / "dl")
    follower = Follower(
        kafka_bootstrap,
        r["topics"]["updates"],
        r["name"],
        sync.on_update,
        lambda alias: current(r["registry"], alias),
        retry_s=0.2,
    ).start()
    try:
        r["registry"].promote("1", actor="test", reason="first", force=True)
        wait_for(lambda: f"{r['name']}-v1" in vllm.loras, 30, "vLLM to load v1 after two refusals")
        assert [status for _, _, status in vllm.lora_calls] == [500, 500, 200]
        assert sync.current == f"{r['name']}-v1"
    finally:
        follower.close()
        upstream.stop()


def test_follower_serves_what_the_registry_says_not_what_an_event_says(registered, kafka_bootstrap):
    """A forged event (another adapter, a version that is a path) and a stale one (an older
    version, as a late repair would send) both only wake the follower: it serves the registry's."""
    r = registered
    registry = r["registry"]
    registry.promote("1", actor="test", reason="first", force=True)
    registry.promote("2", actor="test", reason="second", force=True)
    applied: list[ModelUpdate] = []
    follower = Follower(
        kafka_bootstrap,
        r["topics"]["updates"],
        r["name"],
        applied.append,
        lambda alias: current(registry, alias),
        aliases=("champion", "canary"),
    ).start()
    try:
        for forged in (
            {"version": "../../../tmp/evil", "adapter_uri": "file:///tmp/evil"},
            {"version": "1", "adapter_uri": registry.get("1").source, "seq": 1},
        ):
            registry.publish({"type": "model_update", "name": r["name"], "alias": "champion", **forged})
        wait_for(lambda: len(applied) >= 2, 30, "both events to be handled")
    finally:
        follower.close()
    assert [(u.alias, u.version, u.adapter_uri) for u in applied] == [("champion", "2", registry.get("2").source)] * 2


def test_serve_stops_with_what_to_do_when_it_has_no_base_model_or_one_it_cannot_load(cfg_env, tmp_path):
    """rtrl serve with no --base-model, no train.base_model and no champion stops before it loads
    anything, naming the two ways to give one; a directory that is not a model is named too."""
    from click.testing import CliRunner

    from pipeline.cli import cli

    none = CliRunner().invoke(cli, ["serve", "--port", "1"], env=cfg_env)
    assert none.exit_code == 1, none.output
    assert "no base model: pass --base-model or set train.base_model" in none.output
    missing = CliRunner().invoke(cli, ["serve", "--port", "1", "--base-model", str(tmp_path / "nope")], env=cfg_env)
    assert missing.exit_code == 1, missing.output
    assert str(tmp_path / "nope") in missing.output and "Traceback" not in missing.output
