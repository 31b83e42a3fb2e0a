"""rtrl serve for agents, through the official `openai` client: tools offered and tool calls
parsed (or flagged when the model broke them), follow-up requests carrying earlier calls and
their results, n > 1 as a group, and streaming that reassembles to the unstreamed answer (in
process, through FastAPI's test client).

Where a test needs the model to write a particular tool call, `Scripted` answers with that text
(its tokens, through the server's whole path); the streaming equality runs the real model."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient

from deploy.serving.serve import PolicyServer
from deploy.serving.serve_api import create_app
from pipeline.core.textchecks import malformed_tool_call
from tests.support.helpers import wait_for
from tests.support.scripted import ASK, LOOKUP, Scripted


def client_for(server: PolicyServer) -> openai.OpenAI:
    http = TestClient(create_app(server))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_a_tool_call_round_trips_and_the_follow_up_carries_it(real):
    sent: list[dict] = []
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
    api = client_for(PolicyServer(Scripted(real, call), "policy", emit=sent.append))
    first = api.chat.completions.create(model="policy", messages=ASK, tools=[LOOKUP], max_tokens=64)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "lookup" and json.loads(tc.function.arguments) == {"key": "k1"}
    assert sent[0]["tools"] == [LOOKUP] and sent[0]["tool_calls"][0]["function"]["name"] == "lookup"
    assert "error" not in sent[0]["tool_calls"][0] and sent[0]["completion"] == call  # the text, as written

    follow_up = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
        {"role": "tool", "tool_call_id": tc.id, "content": "stressed"},
    ]
    api.chat.completions.create(model="policy", messages=follow_up, tools=[LOOKUP], max_tokens=64)
    assert sent[1]["prompt"][1]["tool_calls"][0]["id"] == tc.id and sent[1]["prompt"][2]["role"] == "tool"


@pytest.mark.parametrize(
    "written, error",
    [
        ('<tool_call>\n{"name": "search", "arguments": {"q": "x"}}\n</tool_call>', "'search' is not an offered tool"),
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": 7}}\n</tool_call>', "do not match lookup's schema"),
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"</tool_call>', "not JSON"),
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}', "unterminated"),
    ],
)
def test_a_broken_tool_call_is_returned_as_written_and_flagged_in_the_event(real, written, error):
    sent: list[dict] = []
    api = client_for(PolicyServer(Scripted(real, written), "policy", emit=sent.append))
    choice = api.chat.completions.create(model="policy", messages=ASK, tools=[LOOKUP], max_tokens=64).choices[0]
    assert choice.message.tool_calls is None and choice.message.content == written
    assert choice.finish_reason == "stop"
    (flagged,) = sent[0]["tool_calls"]
    assert error in flagged["error"] and malformed_tool_call(flagged)  # what the reward guard sees


def test_n_choices_are_requests_of_one_group(real):
    sent: list[dict] = []
    api = client_for(PolicyServer(real, "policy", emit=sent.append))
    answer = api.chat.completions.create(model="policy", messages=ASK, max_tokens=4, n=3, seed=5, temperature=1.0)
    ids = [c.model_extra["request_id"] for c in answer.choices]
    assert len(set(ids)) == 3 and [e["request_id"] for e in sent] == ids
    assert len({e["group_id"] for e in sent}) == 1 and sent[0]["group_id"].startswith("grp-")
    assert [e["sampling"]["seed"] for e in sent] == [5, 6, 7]  # each choice's own draw
    assert answer.usage.completion_tokens == sum(len(c.logprobs.content) for c in answer.choices)


def test_a_streamed_answer_reassembles_to_the_unstreamed_one(real):
    api = client_for(PolicyServer(real, "policy"))
    kwargs = dict(model="policy", messages=ASK, max_tokens=12, seed=11, temperature=0.9, top_p=0.95)
    whole = api.chat.completions.create(**kwargs).choices[0]
    chunks = list(api.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert text == whole.message.content
    assert [e.model_extra["token_id"] for e in entries] == [e.model_extra["token_id"] for e in whole.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in whole.logprobs.content], abs=1e-5)
    assert chunks[-1].usage.completion_tokens == len(whole.logprobs.content)
    plain = api.completions.create(model="policy", prompt="abc>", max_tokens=6, seed=3, temperature=0.8)
    streamed = "".join(
        c.choices[0].text
        for c in api.completions.create(
            model="policy", prompt="abc>", max_tokens=6, seed=3, temperature=0.8, stream=True
        )
    )
    assert streamed == plain.choices[0].text


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(real):
    call = 'looking <tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
    api = client_for(PolicyServer(Scripted(real, call), "policy"))
    whole = api.chat.completions.create(model="policy", messages=ASK, tools=[LOOKUP], max_tokens=64).choices[0]
    chunks = list(api.chat.completions.create(model="policy", messages=ASK, tools=[LOOKUP], max_tokens=64, stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or ())]
    assert "<tool_call>" not in content and content.strip() == whole.message.content == "looking"
    assert [(tc.function.name, tc.function.arguments) for tc in calls] == [
        (tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls
    ]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


class Failing(Scripted):
    def generate(self, *args, **kwargs):
        raise RuntimeError("CUDA out of memory")


def test_a_streamed_answer_that_fails_says_so_to_the_client_the_log_and_the_metrics(real, caplog):
    server = PolicyServer(Failing(real, ""), "policy", emit=lambda event: None)
    http = TestClient(create_app(server))
    with caplog.at_level("ERROR", logger="rtrl.serve"):
        body = http.post("/v1/chat/completions", json={"messages": ASK, "stream": True}).text
    assert "CUDA out of memory" in body and '"error"' in body
    (record,) = [r for r in caplog.records if r.getMessage() == "a streamed answer failed"]
    assert record.request_id.startswith("req-") and "CUDA out of memory" in record.error

    def counted() -> str | None:  # once the stream's event thread has seen the generation end
        metrics = http.get("/metrics").text
        return metrics if 'outcome="error"} 1.0' in metrics else None

    metrics = wait_for(counted, 30, "the failure counted")
    assert 'outcome="disconnected"' not in metrics
