"""`rtrl gateway` in front of vLLM as it behaves (tests/support/vllm_stub.py: v0.34.0's protocol), driven
by the official `openai` client: log-probs of the distribution that sampled, sampling settings
sent explicitly, streamed tool calls and n > 1 recorded whole, mid-stream errors marked, and
traffic routed only to adapters the upstream has loaded."""

from __future__ import annotations

import json
import math

import openai
import pytest
from fastapi.testclient import TestClient

from deploy.serving.gateway import Gateway
from deploy.serving.gateway_api import create_gateway_app
from deploy.serving.gateway_sampling import classify_probe
from deploy.serving.routing import routes_to_canary
from pipeline.core.textchecks import malformed_tool_call
from pipeline.core.types import ModelUpdate
from tests.support.servers import InProcessServer
from tests.support.vllm_stub import VllmStub, log_softmax, logits, processed

ASK = [{"role": "user", "content": "reverse abc"}]
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


@pytest.fixture
def vllm():
    """(the stub, the gateway in front of it, interaction events, an openai client, the raw http client)."""
    stub = VllmStub(base="base-model", logprobs_mode="processed_logprobs")
    upstream = InProcessServer(stub.app)
    events: list[dict] = []
    gw = Gateway(upstream.url, "policy", events.append, None, ingest_token="t0ken")
    gw.check_logprobs()
    http = TestClient(create_gateway_app(gw), headers={"Authorization": "Bearer t0ken"})
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    yield stub, gw, events, client, http
    upstream.stop()


@pytest.mark.parametrize("mode,seen", [("raw_logprobs", "raw"), ("processed_logprobs", "processed")])
def test_the_probe_tells_raw_log_probs_from_processed(mode, seen):
    stub = VllmStub(logprobs_mode=mode)
    upstream = InProcessServer(stub.app)
    try:
        assert Gateway(upstream.url, "m", None, None).check_logprobs() == seen
    finally:
        upstream.stop()
    tie = [(9, -0.6931), (9, -0.6931), (9, -0.9303)]  # two tokens level at the top: half each when cold
    second = [(9, -1.3133), (9, -0.9741), (9, -1.0)]  # the runner-up drawn at both low temperatures
    assert classify_probe([tie]) == "unknown" and classify_probe([second]) == "processed"
    certain = [(1, -1e-9), (1, -1e-8), (1, -1e-7)]
    assert classify_probe([]) == "unknown" and classify_probe([certain]) == "unknown"  # nothing learnt
    processed_ = [(1, -0.0), (1, -0.0), (1, -2.5)]
    assert classify_probe([processed_, certain]) == "processed"
    assert classify_probe([processed_, [(1, -0.7), (1, -0.7), (1, -0.7)]]) == "raw"  # one raw answer refuses


def test_every_sampling_setting_is_sent_so_no_server_default_differs_from_what_is_logged():
    """vLLM fills what a request leaves out from the model's generation_config (here temperature
    0.6 and a repetition penalty): the log-probs would be of that distribution, the event would
    say temperature 1."""
    stub = VllmStub(
        logprobs_mode="processed_logprobs",
        generation_defaults={"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.05},
    )
    upstream = InProcessServer(stub.app)
    events: list[dict] = []
    try:
        gw = Gateway(upstream.url, "policy", events.append, None)
        TestClient(create_gateway_app(gw)).post(
            "/v1/chat/completions", json={"model": "base-model", "messages": ASK, "max_tokens": 4}
        )
    finally:
        upstream.stop()
    sent = stub.requests[-1]
    assert {
        k: sent[k]
        for k in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        )
    } == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
    }
    assert events[0]["sampling"]["temperature"] == 1.0 and events[0]["sampling"]["top_k"] == 0


def test_logged_log_probs_are_those_training_recomputes_at_the_logged_settings(vllm):
    """The truth: the stub's model at the event's settings (temperature, top-k, top-p) gives each
    served token exactly the logged log-prob (vLLM's processed_logprobs)."""
    stub, gw, events, client, _ = vllm
    assert gw.logprobs_mode == "processed"
    client.chat.completions.create(
        model="base-model", messages=ASK, max_tokens=6, temperature=0.7, top_p=0.9, seed=3, extra_body={"top_k": 12}
    )
    ev = events[0]
    assert ev["sampling"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 12, "max_tokens": 6, "seed": 3}
    sp = {"temperature": 0.7, "top_p": 0.9, "top_k": 12, "min_p": 0.0}
    prompt = json.dumps(stub.requests[-1]["messages"])
    for i, (token, logged) in enumerate(zip(ev["completion_token_ids"], ev["behavior_logprobs"])):
        truth = log_softmax(processed(logits("base-model", prompt, ev["completion_token_ids"][:i]), sp))[token]
        assert math.isclose(logged, truth, abs_tol=1e-9)


def test_raw_log_probs_are_kept_only_where_they_are_the_sampled_distribution_s():
    stub = VllmStub(logprobs_mode="raw_logprobs")  # vLLM's default
    upstream = InProcessServer(stub.app)
    events: list[dict] = []
    try:
        gw = Gateway(upstream.url, "policy", events.append, None)
        assert gw.check_logprobs() == "raw"
        http = TestClient(create_gateway_app(gw))
        for temperature in (0.7, 1.0):
            http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "temperature": temperature})
    finally:
        upstream.stop()
    warm, neutral = events
    assert warm.get("behavior_logprobs") is None and warm["completion_token_ids"]  # the answer kept, its log-probs not
    assert "--logprobs-mode processed_logprobs" in warm["metadata"]["behavior_logprobs_dropped"]
    assert len(neutral["behavior_logprobs"]) == len(neutral["completion_token_ids"]) > 0  # raw = processed at 1


@pytest.mark.parametrize(
    "extra,reason",
    [
        ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"tools": [{**LOOKUP, "function": {**LOOKUP["function"], "strict": True}}]}, "strict tools"),
        ({"tools": [LOOKUP], "parallel_tool_calls": False}, "strict tools or parallel_tool_calls"),
    ],
)
def test_settings_training_cannot_recompute_keep_the_answer_without_its_log_probs(vllm, extra, reason):
    _, _, events, _, http = vllm
    # seeded, so the stub draws the same answer every run: an empty one (the end token drawn
    # first) has no token ids and no log-probs to drop
    http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "seed": 0, **extra})
    assert events[0].get("behavior_logprobs") is None and events[0]["completion_token_ids"]
    assert events[0]["metadata"]["behavior_logprobs_dropped"].startswith(reason)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("arguments,broken", [({"key": "k1"}, False), ("{'key': k1", True)])
def test_a_streamed_tool_call_is_recorded_whole(vllm, split, arguments, broken):
    """vLLM streams a call as its name, then pieces of its arguments (the name and the first
    piece sometimes in one chunk): the event holds the call the user got, so broken arguments
    are seen as broken by the tool-format guard."""
    stub, _, events, client, _ = vllm
    stub.tool_call, stub.split_name_and_first_piece = {"name": "lookup", "arguments": arguments}, split
    chunks = list(
        client.chat.completions.create(model="base-model", messages=ASK, tools=[LOOKUP], max_tokens=120, stream=True)
    )
    pieces = [tc.function.arguments or "" for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    (call,) = events[0]["tool_calls"]
    assert (
        call["function"]
        == {"name": "lookup", "arguments": json.dumps(arguments)}
        == {"name": "lookup", "arguments": "".join(pieces)}
    )
    assert call["id"].startswith("chatcmpl-tool-") and malformed_tool_call(call) is broken


def test_a_streamed_answer_with_n_choices_is_one_event_per_choice(vllm):
    stub, gw, events, client, _ = vllm
    chunks = list(
        client.chat.completions.create(model="base-model", messages=ASK, max_tokens=6, n=2, seed=5, stream=True)
    )
    text = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            text[choice.index] += choice.delta.content or ""
    assert len(events) == 2 and [e["completion"] for e in events] == [text[0], text[1]]
    assert events[0]["request_id"] == chunks[0].id != events[1]["request_id"]
    assert events[0]["group_id"] == events[1]["group_id"] is not None
    second = [ch.model_extra.get("request_id") for c in chunks for ch in c.choices if ch.index == 1]
    assert set(second) == {events[1]["request_id"]}  # the client can report the second choice's outcome
    for ev in events:
        assert len(ev["completion_token_ids"]) == len(ev["behavior_logprobs"]) == len(ev["completion"])


def test_n_choices_unstreamed_each_have_their_own_request_id_and_one_group(vllm):
    _, gw, events, client, http = vllm
    answer = client.chat.completions.create(model="base-model", messages=ASK, max_tokens=5, n=3, seed=1)
    ids = [c.model_extra["request_id"] for c in answer.choices]
    assert [e["request_id"] for e in events] == ids and ids[0] == answer.id and len(set(ids)) == 3
    assert len({e["group_id"] for e in events}) == 1 and events[0]["group_id"] is not None
    assert [e["completion"] for e in events] == [c.message.content for c in answer.choices]
    http.post("/v1/feedback", json={"request_id": ids[2], "kind": "accepted", "value": True})
    assert gw.metrics.get_sample_value("rtrl_gateway_feedback_unknown_request_total") == 0


def test_an_error_mid_stream_reaches_the_client_and_marks_the_event(vllm):
    stub, gw, events, client, _ = vllm
    stub.fail_after = 2
    with pytest.raises(openai.APIError, match="Internal server error"):
        list(client.chat.completions.create(model="base-model", messages=ASK, max_tokens=8, stream=True))
    (ev,) = events
    assert ev["truncated"] is True and ev["metadata"]["upstream_error"] == "Internal server error"
    assert len(ev["completion"]) == 2  # what the user saw, kept, and not trained on
    assert (
        gw.metrics.get_sample_value("rtrl_gateway_requests_total", {"endpoint": "chat", "outcome": "upstream_error"})
        == 1
    )


def test_traffic_goes_to_an_adapter_only_once_the_upstream_serves_it(vllm, tmp_path):
    """The registry moves before vLLM has loaded the adapter (rtrl serve --vllm downloads it
    first): the gateway keeps routing to what is served, then switches once /v1/models lists it."""
    stub, gw, events, client, http = vllm
    adapter = tmp_path / "a"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    gw.on_update(ModelUpdate("champion", "3", "runs:/a/adapter"))
    answer = http.post("/v1/chat/completions", json={"model": "base-model", "messages": ASK, "max_tokens": 2})
    assert answer.status_code == 200 and answer.headers["X-Rtrl-Policy-Version"] == "base"
    assert stub.requests[-1]["model"] == "base-model" and gw.reconcile() is False
    assert gw.metrics.get_sample_value("rtrl_gateway_routing_settled") == 0
    assert http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2}).status_code == 200
    # the canary too: staged before vLLM has it, no share of the traffic goes to it
    gw.on_update(ModelUpdate("canary", "4", "runs:/b/adapter", share=1.0))
    assert gw.route("req-x") == ("base", None)
    TestClient(stub.app).post("/v1/load_lora_adapter", json={"lora_name": "policy-v3", "lora_path": str(adapter)})
    assert gw.reconcile() is False and gw.route("req-x") == ("3", "policy-v3")  # the champion, not yet the canary
    TestClient(stub.app).post("/v1/load_lora_adapter", json={"lora_name": "policy-v4", "lora_path": str(adapter)})
    assert gw.reconcile() is True and gw.route("req-x") == ("4", "policy-v4")
    answer = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert answer.headers["X-Rtrl-Policy-Version"] == "4" and stub.requests[-1]["model"] == "policy-v4"
    # the canary's adapter unloaded before the gateway's next poll: the request is routed anew, not a 404
    TestClient(stub.app).post("/v1/unload_lora_adapter", json={"lora_name": "policy-v4"})
    answer = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
    assert answer.status_code == 200 and answer.headers["X-Rtrl-Policy-Version"] == "3"
    assert all(r["model"] != "policy-v4" for r in stub.requests[-1:])


def test_the_router_decides_which_version_answers_never_the_client(vllm, tmp_path):
    """While the base serves, a client's `model` naming an adapter reached vLLM as sent (the
    event said "base"); an episode id hashed to a side anyone could compute."""
    stub, gw, events, client, http = vllm
    stub.loras = {"policy-v4": str(tmp_path)}  # an old adapter, or a canary: loaded on vLLM
    gw.reconcile()
    answer = http.post("/v1/chat/completions", json={"model": "policy-v4", "messages": ASK, "max_tokens": 2})
    assert answer.status_code == 200 and stub.requests[-1]["model"] == "base-model"
    assert answer.headers["X-Rtrl-Policy-Version"] == events[-1]["policy_version"] == "base"
    episodes = [f"task-{i}" for i in range(400)]
    gw.champion, gw.canary, gw.canary_share = "3", "4", 0.5
    mine = [gw.route(e)[0] for e in episodes]
    other = Gateway(gw.upstream, "policy", None, None, routing_secret="another")
    other.champion, other.canary, other.canary_share = "3", "4", 0.5
    unsalted = ["4" if routes_to_canary(e, 0.5) else "3" for e in episodes]
    assert 150 < mine.count("4") < 250 and mine != unsalted and mine != [other.route(e)[0] for e in episodes]
    replica = Gateway(gw.upstream, "policy", None, None, routing_secret=gw.routing_secret)
    replica.champion, replica.canary, replica.canary_share = "3", "4", 0.5
    assert [replica.route(e)[0] for e in episodes] == mine  # replicas sharing the secret agree


@pytest.mark.parametrize("body,status", [(b"not json", 502), (b"[1, 2]", 502)])
def test_an_unreadable_answer_is_a_502_not_a_500(body, status):
    from tests.support.vllm_instant import read_body

    async def upstream(scope, receive, send):
        if scope["type"] != "http":
            return
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    server = InProcessServer(upstream)
    try:
        http = TestClient(create_gateway_app(Gateway(server.url, "policy", None, None)))
        answer = http.post("/v1/chat/completions", json={"messages": ASK})
        assert answer.status_code == status and "unreadable" in answer.json()["error"]["message"]
    finally:
        server.stop()


@pytest.mark.parametrize(
    "chunk", [b"[1, 2]", b'{"choices": [{"index": null, "delta": {"content": "a"}}]}', b'{"choices": ["oops"]}']
)
def test_an_odd_stream_chunk_ends_the_stream_with_an_error_frame(chunk):
    """Anything the relay cannot read -- valid JSON that is no chunk included -- is the upstream
    failing mid-stream: the client gets an error frame and [DONE], never a stream that just stops."""
    from tests.support.vllm_instant import read_body

    first = b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'

    async def upstream(scope, receive, send):
        if scope["type"] != "http":
            return
        await read_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": first + b"data: " + chunk + b"\n\ndata: [DONE]\n\n"})

    server = InProcessServer(upstream)
    events: list[dict] = []
    try:
        gw = Gateway(server.url, "policy", events.append, None)
        text = (
            TestClient(create_gateway_app(gw)).post("/v1/chat/completions", json={"messages": ASK, "stream": True}).text
        )
    finally:
        server.stop()
    if b"null" in chunk:  # an index of null is the first choice's
        assert '"error"' not in text and events[0]["completion"] == "Hia"
        return
    assert '"error"' in text and text.endswith("data: [DONE]\n\n")
    assert (
        events[0]["completion"] == "Hi" and events[0]["truncated"] is True and "upstream_error" in events[0]["metadata"]
    )


def test_a_request_body_too_large_or_too_slow_is_refused_not_read_forever(vllm):
    """No limit on a body's size or on how long it takes: one client could fill the memory, or
    hold a connection open by trickling its body."""
    import socket

    _, gw, events, _, http = vllm
    gw.max_body_bytes, gw.body_timeout_s = 10_000, 1.0
    big = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 20_000}]})
    assert big.status_code == 413 and events == []
    assert http.post("/v1/chat/completions", content=b"not json").status_code == 400
    server = InProcessServer(create_gateway_app(gw))
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 500\r\n\r\n{"messages": '
            )  # ... and the rest never comes
            answer = sock.recv(4096)  # (a socket timeout of 10 s: an answer, not a hang)
        assert answer.startswith(b"HTTP/1.1 408")
    finally:
        server.stop()


def test_the_client_gets_tokens_as_it_asked_top_alternatives_and_completions_included(vllm):
    """The gateway asked vLLM for every token as "token_id:<id>" and turned the sampled ones back
    into text from their bytes -- but a top-N alternative's bytes are those of "token_id:<id>",
    and a completion's tokens have none. It now asks for the ids apart (`return_token_ids`)."""
    stub, _, events, client, http = vllm
    chat = client.chat.completions.create(model="base-model", messages=ASK, max_tokens=4, logprobs=True, seed=2)
    assert not any(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)
    assert stub.requests[-1]["return_token_ids"] is True and not stub.requests[-1].get("return_tokens_as_token_ids")
    assert events[-1]["completion_token_ids"] == [ord(c) - 31 for c in chat.choices[0].message.content]
    done = http.post("/v1/completions", json={"prompt": "The", "max_tokens": 4, "logprobs": 1, "seed": 2}).json()
    assert "".join(done["choices"][0]["logprobs"]["tokens"]) == done["choices"][0]["text"]
    assert "token_ids" not in done["choices"][0]  # not asked for
    assert events[-1]["completion_token_ids"] == [ord(c) - 31 for c in done["choices"][0]["text"]]
    streamed = list(client.completions.create(model="base-model", prompt="The", max_tokens=4, seed=2, stream=True))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert events[-1]["completion_token_ids"] == [ord(c) - 31 for c in text] and text


def test_the_conformance_checks_a_real_vllm_gets_pass_against_the_stand_in(tmp_path):
    """benchmarks/vllm_conformance.py runs on a GPU machine against vLLM itself: the same checks
    against the stand-in tell that the stand-in answers as the checks expect vLLM to."""
    from benchmarks.vllm_conformance import run

    stub = VllmStub(logprobs_mode="processed_logprobs")
    stub.tool_call = {"name": "lookup", "arguments": {"key": "k1"}}
    (tmp_path / "adapter_config.json").write_text("{}")
    server = InProcessServer(stub.app)
    try:
        assert run(server.url, tmp_path) == 0
    finally:
        server.stop()
