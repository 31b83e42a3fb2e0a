"""`rtrl serve` behind a gateway, in process: the version the model field names answers, and
rtrl serve leaves the interaction event to the gateway in front of it."""

from __future__ import annotations

from deploy.serving.routing import routing_signature
from deploy.serving.serve import PolicyServer
from deploy.serving.serve_requests import ChatRequest
from tests.support.scripted import ASK


def test_rtrl_serve_behind_a_gateway_answers_with_the_version_the_model_names(real):
    """As vLLM serves the LoRA a request's `model` names: the gateway in front then decides the
    canary's share -- only the gateway, whose signature (the shared routing secret) the choice
    carries. A name that is not the champion or the canary is routed by the server."""
    server = PolicyServer(real, "policy")
    server.version, server.canary, server.canary_share = "3", "4", 0.5
    assert [server.named(m) for m in ("policy-v4", "policy-v3", "policy-v5", "other-v3", "policy", None)] == [
        "4",
        "3",
        None,
        None,
        None,
        None,
    ]
    # the base champion has no adapter name: the gateway's header says it chose the champion, and
    # the server must not split that request again (the canary answered 68 % instead of 50 % in
    # a demo through the gateway: half of the base's share went to the canary a second time)
    server.version, server.canary_share = "base", 1.0  # the canary (not loaded here) would take every request
    req = ChatRequest(model="policy", messages=ASK, max_tokens=2)
    signed = {
        "x-request-id": "req-1",
        "x-rtrl-routed": "champion",
        "x-rtrl-routed-signature": routing_signature(server.routing_secret, "req-1", "champion", "policy"),
    }
    (answer,) = server.answer(ASK, req, signed, send_event=False)
    assert answer.version == "base"
    # a client's own choice chooses nothing: unsigned, or signed with another secret
    forged = {**signed, "x-rtrl-routed-signature": routing_signature("guess", "req-1", "champion", "policy")}
    server.version, server.canary_share = "3", 1.0
    assert [
        server.choose(m, h, "req-1")
        for m, h in (("policy-v3", {}), ("policy", {"x-rtrl-routed": "champion"}), ("policy", forged))
    ] == ["4", "4", "4"]
    assert (
        server.choose(
            "policy-v3",
            {
                **signed,
                "x-rtrl-routed-signature": routing_signature(server.routing_secret, "req-1", "champion", "policy-v3"),
            },
            "req-1",
        )
        == "3"
    )


def test_rtrl_serve_behind_a_gateway_leaves_the_event_to_the_gateway(real):
    """Each call was recorded twice -- the gateway's event and rtrl serve's own, never rewarded."""
    sent: list[dict] = []
    server = PolicyServer(real, "policy", emit=sent.append)
    req = ChatRequest(model="policy", messages=ASK, max_tokens=2)
    signed = {
        "x-request-id": "req-9",
        "x-rtrl-routed": "champion",
        "x-rtrl-routed-signature": routing_signature(server.routing_secret, "req-9", "champion", "policy"),
    }
    server.answer(ASK, req, signed)
    assert sent == []
    server.answer(ASK, req, {"x-rtrl-routed": "champion"})  # unsigned: a client of its own
    assert len(sent) == 1
