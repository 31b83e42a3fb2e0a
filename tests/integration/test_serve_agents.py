"""rtrl serve for agents on a real socket: a client that goes away mid-stream, or before the
first token, leaves an event marked truncated."""

from __future__ import annotations

import requests

from deploy.serving.serve import PolicyServer
from deploy.serving.serve_api import create_app
from tests.support.helpers import wait_for
from tests.support.scripted import ASK, Scripted
from tests.support.servers import InProcessServer


def stream_and_leave(policy) -> dict:
    """Serve `policy` on a real socket, read a streamed chat answer's first chunk and go away;
    the one interaction event the server then sends."""
    sent: list[dict] = []
    http = InProcessServer(create_app(PolicyServer(policy, "policy", emit=sent.append)))
    try:
        with requests.post(
            f"{http.url}/v1/chat/completions",
            stream=True,
            timeout=30,
            json={"messages": ASK, "max_tokens": 300, "stream": True},
        ) as response:
            assert next(response.iter_lines()).startswith(b"data: ")  # the first chunk arrived; then the client leaves
        wait_for(lambda: sent, 30, "the interaction event")
    finally:
        http.stop()
    (event,) = sent
    return event


def test_a_client_that_goes_away_mid_stream_stops_generation_and_its_event_is_marked_truncated(real):
    event = stream_and_leave(Scripted(real, "x" * 200, delay_s=0.02))
    assert event["truncated"] is True and len(event["completion_token_ids"]) < 201  # stopped early


class LateStart(Scripted):
    """A generation that starts only once the client has gone: the worker thread was slow to be
    scheduled (the suite on two busy cores), and the chat stream's first chunk -- the role, sent
    before any token -- was all the client read."""

    def generate(self, *args, stop=None, **kwargs):
        wait_for(lambda: stop.is_set(), 30, "the client to go away")
        return super().generate(*args, stop=stop, **kwargs)


def test_a_client_that_goes_away_before_the_first_token_still_gets_its_event_marked_truncated(real):
    event = stream_and_leave(LateStart(real, "x" * 200))
    assert event["truncated"] is True and len(event["completion_token_ids"]) == 1
