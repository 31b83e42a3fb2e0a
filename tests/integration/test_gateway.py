"""`rtrl gateway` in front of a real OpenAI-compatible server (`rtrl serve`), driven by the
official `openai` client: the client gets the answer in the shape it asked for, the loop gets
the interaction event with the served tokens' ids and log-probs (streamed or not, tools passed
through), outcomes come in through /v1/feedback, and an upstream that fails gives no event."""

from __future__ import annotations

import threading

import openai
import pytest
from fastapi.testclient import TestClient

from deploy.serving.gateway import Gateway
from deploy.serving.gateway_api import create_gateway_app
from deploy.serving.serve import PolicyServer
from deploy.serving.serve_api import create_app
from pipeline.core.types import ModelUpdate
from tests.support.helpers import wait_for
from tests.support.scripted import ASK, LOOKUP, Scripted
from tests.support.servers import InProcessServer
from tests.support.vllm_stub import VllmStub

TOKEN = "ingest-secret"


@pytest.fixture
def through(real):
    """(openai client through the gateway, the gateway, interaction events, feedback events, upstream)."""
    interactions, feedback = [], []
    upstream = InProcessServer(create_app(PolicyServer(real, "policy")))
    gw = Gateway(upstream.url, "policy", interactions.append, feedback.append, ingest_token=TOKEN)
    assert gw.check_logprobs() == "processed"  # rtrl serve's are the sampled distribution's
    http = TestClient(create_gateway_app(gw), headers={"Authorization": f"Bearer {TOKEN}"})
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    yield client, gw, interactions, feedback, upstream, http
    upstream.stop()


def test_the_client_gets_what_it_asked_for_and_the_event_what_training_needs(through, real):
    client, gw, events, _, _, _ = through
    plain = client.chat.completions.create(model="policy", messages=ASK, max_tokens=6, seed=2, temperature=0.8)
    assert plain.choices[0].logprobs is None  # not asked for: removed
    assert len(events) == 1  # kept before the answer was given, not after
    ev = events[0]
    assert ev["request_id"] == plain.id and ev["completion"] == plain.choices[0].message.content
    assert len(ev["completion_token_ids"]) == len(ev["behavior_logprobs"]) > 0
    assert (
        real.tokenizer.decode([t for t in ev["completion_token_ids"] if t != real.tokenizer.eos_token_id])
        == ev["completion"]
    )
    # what sampled the tokens, sent to the upstream explicitly and recorded
    assert ev["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "max_tokens": 6, "seed": 2}
    assert ev["policy_version"] == "base"
    asked = client.chat.completions.create(model="policy", messages=ASK, max_tokens=4, seed=2, logprobs=True)
    assert not any(e.token.startswith("token_id:") for e in asked.choices[0].logprobs.content)  # text, as asked


def test_a_stream_through_the_gateway_and_its_event_once_it_ends(through):
    client, _, events, _, _, _ = through
    chunks = list(client.chat.completions.create(model="policy", messages=ASK, max_tokens=8, seed=4, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert all(c.choices[0].logprobs is None for c in chunks if c.choices)
    assert len(events) == 1  # kept before the stream's [DONE]
    assert events[0]["completion"] == text and events[0]["request_id"] == chunks[0].id
    assert len(events[0]["completion_token_ids"]) == len(events[0]["behavior_logprobs"]) > 0
    assert "truncated" not in events[0]


def test_each_of_n_choices_has_its_own_event_with_its_own_answer(through):
    client, _, events, _, _, _ = through
    answer = client.chat.completions.create(model="policy", messages=ASK, max_tokens=8, seed=3, n=3, temperature=1.0)
    assert len(answer.choices) == len(events) == 3
    assert [e["completion"] for e in events] == [c.message.content for c in answer.choices]
    assert len({e["event_id"] for e in events}) == 3
    assert len({tuple(e["completion_token_ids"]) for e in events}) > 1  # (sampled: the three differ)


def test_tool_calls_pass_through_and_reach_the_event(real):
    events: list[dict] = []
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
    upstream = InProcessServer(create_app(PolicyServer(Scripted(real, call), "policy")))
    try:
        gw = Gateway(upstream.url, "policy", events.append, None)
        client = openai.OpenAI(
            base_url="http://testserver/v1",
            api_key="unused",
            http_client=TestClient(create_gateway_app(gw)),
            max_retries=0,
        )
        answer = client.chat.completions.create(model="policy", messages=ASK, tools=[LOOKUP], max_tokens=64)
        assert answer.choices[0].message.tool_calls[0].function.name == "lookup"
        wait_for(lambda: events, 10, "the event")
        assert events[0]["tools"] == [LOOKUP] and events[0]["tool_calls"][0]["function"]["name"] == "lookup"
    finally:
        upstream.stop()


def test_feedback_is_validated_and_counted_when_its_request_is_unknown(through):
    client, gw, _, feedback, _, http = through
    answer = client.chat.completions.create(model="policy", messages=ASK, max_tokens=2)
    ok = http.post("/v1/feedback", json={"request_id": answer.id, "kind": "accepted", "value": True})
    assert ok.status_code == 202 and feedback[0]["request_id"] == answer.id and feedback[0]["value"] is True
    bad = http.post("/v1/feedback", json={"request_id": answer.id, "kind": "accepted", "value": "yes"})
    assert bad.status_code == 422 and bad.json()["error"]["param"].startswith("value")
    assert len(feedback) == 1
    assert http.post("/v1/feedback", content=b"[1, 2]").status_code == 400  # not a JSON object: refused
    assert http.post("/v1/chat/completions", content=b"{nope").status_code == 400
    http.post("/v1/feedback", json={"request_id": "req-elsewhere", "kind": "accepted", "value": 1})
    assert len(feedback) == 2  # accepted: the join handles any order, and counted
    assert gw.metrics.get_sample_value("rtrl_gateway_feedback_unknown_request_total") == 1


def test_an_episode_s_outcome_is_feedback_naming_the_episode(through):
    client, gw, events, feedback, _, http = through
    client.chat.completions.create(
        model="policy", messages=ASK, max_tokens=2, extra_headers={"X-Rtrl-Episode-Id": "task-7", "X-Rtrl-Step": "0"}
    )
    ok = http.post("/v1/feedback", json={"episode_id": "task-7", "kind": "persisted", "value": True})
    assert ok.status_code == 202 and ok.json()["episode_id"] == "task-7" and "request_id" not in ok.json()
    assert feedback[-1]["episode_id"] == "task-7" and "request_id" not in feedback[-1]
    assert "tenant" not in feedback[-1]  # none named (no X-Tenant, as its calls): the episode id in every tenant
    assert gw.metrics.get_sample_value("rtrl_gateway_feedback_unknown_request_total") == 0  # it was answered
    other = http.post(
        "/v1/feedback",
        json={"episode_id": "task-7", "kind": "persisted", "value": True},
        headers={"X-Tenant": "globex"},
    )  # another tenant's task-7: not an episode answered here
    assert other.status_code == 202 and feedback[-1]["tenant"] == "globex"
    assert gw.metrics.get_sample_value("rtrl_gateway_feedback_unknown_request_total") == 1
    both = http.post("/v1/feedback", json={"episode_id": "task-7", "request_id": "r", "kind": "x", "value": 1})
    assert both.status_code == 422 and "exactly one of request_id" in both.json()["error"]["message"]
    wait_for(lambda: events, 10, "the interaction event")
    assert events[-1]["episode_id"] == "task-7" and events[-1]["step"] == 0


def test_the_canary_s_share_is_drawn_per_episode(through):
    """Every call of an agent's episode goes the way its episode id hashes (one version answers
    the whole episode); a request without one is routed by its own request id."""
    client, gw, events, _, _, _ = through
    keys, route = [], gw.route_side
    gw.route_side = lambda key: keys.append(key) or route(key)
    for _ in range(2):
        client.chat.completions.create(
            model="policy", messages=ASK, max_tokens=2, extra_headers={"X-Rtrl-Episode-Id": "task-9"}
        )
    raw = client.chat.completions.with_raw_response.create(model="policy", messages=ASK, max_tokens=2)
    assert keys == ["task-9", "task-9", raw.headers["X-Request-Id"]]


def test_an_upstream_error_or_absence_reaches_the_client_and_produces_no_event(through):
    client, gw, events, _, upstream, _ = through
    with pytest.raises(openai.BadRequestError) as err:  # rtrl serve refuses `stop`: its 400, passed on
        client.chat.completions.create(model="policy", messages=ASK, max_tokens=2, stop=["\n"])
    assert "stop is not supported" in err.value.message
    upstream.stop()
    with pytest.raises(openai.InternalServerError) as err:
        client.chat.completions.create(model="policy", messages=ASK, max_tokens=2)
    assert err.value.status_code == 502 and "unreachable" in err.value.message
    assert events == []


def test_routing_follows_the_champion_and_the_canary_s_share():
    stub = VllmStub(base="base-model")
    stub.loras = {"m-v3": "/adapters/3", "m-v4": "/adapters/4"}  # loaded: the upstream lists both
    upstream = InProcessServer(stub.app)
    try:
        gw = Gateway(upstream.url, "m", None, None)
        assert gw.route("req-1") == ("base", None)
        gw.on_update(ModelUpdate("champion", "3", "runs:/a/adapter"))
        gw.on_update(ModelUpdate("canary", "4", "runs:/b/adapter", share=0.5))
        routed = [gw.route(f"req-{i}") for i in range(400)]
        assert {r for r in routed} == {("3", "m-v3"), ("4", "m-v4")}
        assert 150 < sum(r[0] == "4" for r in routed) < 250
        gw.on_update(ModelUpdate("canary", None))
        assert gw.route("req-1") == ("3", "m-v3")
    finally:
        upstream.stop()


def test_vllm_s_fields_as_its_server_gives_them():
    """vLLM cannot run here: its answer's shape (tests/support/fixtures/vllm_chat_completion.json, from its
    protocol definitions) served by a stand-in, to check the fields the gateway reads and rewrites."""
    import json
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from tests.support.helpers import REPO

    canned = (REPO / "tests" / "support" / "fixtures" / "vllm_chat_completion.json").read_bytes()
    asked: list[dict] = []

    class VllmShaped(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(canned)

        def log_message(self, *_):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), VllmShaped)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        events: list[dict] = []
        gw = Gateway(f"http://127.0.0.1:{httpd.server_port}", "rtrl-policy", events.append, None)
        gw.champion = "3"  # routed (this stand-in has no /v1/models to say it serves the adapter)
        gw.logprobs_mode = "processed"
        http = TestClient(create_gateway_app(gw))
        answer = http.post("/v1/chat/completions", json={"model": "my-model", "messages": ASK, "logprobs": True})
        body = answer.json()
        assert asked[0]["model"] == "rtrl-policy-v3" and asked[0]["logprobs"] is True
        assert asked[0]["return_token_ids"] is True and "return_tokens_as_token_ids" not in asked[0]
        assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == ["H", "é", "llo"]  # as asked: text
        assert answer.headers["X-Rtrl-Policy-Version"] == "3" and body["id"] == answer.headers["X-Request-Id"]
        wait_for(lambda: events, 10, "the event")
        assert events[0]["completion_token_ids"] == [39, 4417, 654]
        assert events[0]["behavior_logprobs"] == [-0.25, -1.5, -0.125] and events[0]["policy_version"] == "3"
    finally:
        httpd.shutdown()


def test_a_streamed_rtrl_serve_answer_says_which_version_produced_it(through):
    _, _, _, _, upstream, _ = through
    import requests

    with requests.post(
        f"{upstream.url}/v1/chat/completions",
        stream=True,
        timeout=60,
        json={"model": "policy", "messages": ASK, "max_tokens": 3, "stream": True},
    ) as answer:
        assert answer.headers["X-Rtrl-Policy-Version"] == "base"
        assert b"[DONE]" in b"".join(answer.iter_content(None))


def test_rtrl_serve_keeps_a_streamed_answer_s_event_before_its_done(real):
    """The event was sent after [DONE], from a daemon thread: a server killed once the client had
    its answer lost it. Here the event's append holds the stream: [DONE] comes only after it."""
    import threading

    import requests

    entered, release, seen_done = threading.Event(), threading.Event(), threading.Event()
    kept: list[dict] = []

    def emit(event: dict) -> None:
        entered.set()
        kept.append((event, seen_done.is_set()))
        release.wait(30)

    upstream = InProcessServer(create_app(PolicyServer(real, "policy", emit=emit)))
    try:

        def read() -> None:
            with requests.post(
                f"{upstream.url}/v1/chat/completions",
                stream=True,
                timeout=60,
                json={"model": "policy", "messages": ASK, "max_tokens": 3, "stream": True},
            ) as answer:
                for line in answer.iter_lines():
                    if line == b"data: [DONE]":
                        seen_done.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        wait_for(entered.is_set, 30, "the event's append")
        assert not seen_done.is_set()
        release.set()
        reader.join(timeout=30)
        assert seen_done.is_set() and len(kept) == 1 and kept[0][1] is False
    finally:
        release.set()
        upstream.stop()
