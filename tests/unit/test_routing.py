"""The router's choice (deploy/serving/routing.py): the canary gets its share, a request always
the same way."""

from __future__ import annotations

from deploy.serving import routing


def test_routing_sends_the_share_to_the_canary_and_a_request_always_the_same_way():
    ids = [f"req-{i}" for i in range(20_000)]
    routed = [routing.routes_to_canary(r, 0.2) for r in ids]
    assert abs(sum(routed) / len(ids) - 0.2) < 0.01
    assert routed == [routing.routes_to_canary(r, 0.2) for r in ids]
    assert not any(routing.routes_to_canary(r, 0.0) for r in ids[:1000])
