"""rtrl serve's OpenAI-compatible surface, through the official `openai` client: what it
implements answers in the shape asked for (with usage), and every parameter it does not
implement is refused with a 400 that names it -- never silently ignored."""

from __future__ import annotations

import openai
import orjson
import pytest
from fastapi.testclient import TestClient

from deploy.serving.serve import PolicyServer
from deploy.serving.serve_api import create_app
from train.inference import PolicySet


@pytest.fixture(scope="module")
def client(reverse_base):
    server = PolicyServer(PolicySet.load(reverse_base, device="cpu"), "policy")
    http = TestClient(create_app(server))  # an httpx.Client: the official client runs over it unchanged
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


MESSAGES = [{"role": "system", "content": "reverse"}, {"role": "user", "content": "abc"}]


def test_plain_chat_and_completions_answer_with_usage(client):
    chat = client.chat.completions.create(
        model="policy", messages=MESSAGES, max_tokens=3, temperature=0.7, top_p=0.9, seed=1
    )
    choice = chat.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == chat.usage.completion_tokens <= 3
    assert (
        chat.usage.prompt_tokens > 0
        and chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    )
    newer = client.chat.completions.create(model="policy", messages=MESSAGES, max_completion_tokens=2, seed=1)
    assert newer.usage.completion_tokens <= 2
    text = client.completions.create(model="policy", prompt="abc>", max_tokens=3, temperature=0)
    assert text.usage.prompt_tokens == 4 and text.choices[0].text is not None


@pytest.mark.parametrize(
    "extra, named",
    [
        ({"tool_choice": "required"}, "tool_choice='required' is not supported"),
        ({"tool_choice": {"type": "function", "function": {"name": "lookup"}}}, "tool_choice={'type'"),
        ({"stop": ["\n"]}, "stop is not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format is not supported"),
        ({"presence_penalty": 0.5}, "presence_penalty=0.5 is not supported"),
    ],
)
def test_a_parameter_the_server_does_not_implement_is_refused_naming_it(client, extra, named):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2, **extra)
    assert err.value.status_code == 400 and named in err.value.message
    assert err.value.body["param"] == next(iter(extra))


def test_n_with_stream_is_refused_saying_so(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2, n=2, stream=True)
    assert "n > 1 with stream=True is not supported" in err.value.message


def test_the_interaction_event_is_the_contract_s_and_a_user_it_cannot_carry_is_refused(reverse_base):
    from ingest.decode import decode
    from pipeline.core.decoded import DecodedInteraction
    from pipeline.core.types import SourcePosition

    sent: list[dict] = []
    server = PolicyServer(PolicySet.load(reverse_base, device="cpu"), "policy", emit=sent.append)
    http = TestClient(create_app(server))
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    api.chat.completions.create(
        model="policy",
        messages=MESSAGES,
        max_tokens=2,
        seed=1,
        user="u-1",
        extra_headers={"X-Session-Id": "s-1", "X-Request-Id": "x" * 300},
    )
    event = decode(orjson.dumps(sent[0]), SourcePosition(source="t", partition=0, offset=0), 1 << 20)
    assert isinstance(event, DecodedInteraction), event
    assert (event.user_id, event.session_id, event.client_request_id) == ("u-1", "s-1", "x" * 256)
    with pytest.raises(openai.BadRequestError) as err:  # a NUL the store could not hold: refused up front
        api.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=2, user="a\u0000b")
    assert err.value.body["param"] == "user" and len(sent) == 1
