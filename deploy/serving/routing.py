"""Which version answers a request: the router's choice, the same in rtrl serve and rtrl gateway.

    canary  iff  blake2b_salt(episode_id or request_id) / 2**64 < share
      salt = the deployment's RTRL_ROUTING_SECRET and the canary's version: only the router
      decides, never the client (a client that picks an episode id cannot pick its side)
    a gateway in front of rtrl serve proves its choice with a keyed hash of the request's id and
      the choice (routing_signature): the server behind it follows a signed choice and no other

The online test that then compares the two sides is deploy/rollout.py's.
"""

from __future__ import annotations

import hashlib


def routes_to_canary(key: str, share: float, salt: str = "") -> bool:
    """The canary serves this request: a stable hash of `key` -- the request's episode id when
    it names one, else its request id -- below `share` (the same key always goes the same way, so
    an episode's calls all go to one version; over many keys, `share` of them go to the canary).
    `salt`: the server's secret and the canary's version (routing_salt): without it a client
    could pick an episode id that hashes to the side it wants, and the comparison would no longer
    be a randomised one."""
    secret = hashlib.blake2b(salt.encode()).digest() if salt else b""  # (a key of any length: 64 bytes)
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=secret).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < share


def routing_salt(secret: str, canary: str | None) -> str:
    """What salts the canary's hash: the deployment's RTRL_ROUTING_SECRET (the same for every
    replica of the gateway and of rtrl serve, so that an episode's calls agree) and the canary's
    version (each canary draws its own sample of episodes)."""
    return f"{secret}|v{canary}" if secret else ""


def routing_signature(secret: str, request_id: str, routed: str, model: str | None) -> str:
    """A router's proof, to the server behind it, that it chose the version (rtrl gateway in
    front of rtrl serve): a keyed hash of the request's id and the choice -- no secret on the
    wire, and a client that cannot compute it cannot choose."""
    message = f"{request_id}|{routed}|{model or ''}".encode()
    return hashlib.blake2b(message, key=hashlib.blake2b(secret.encode()).digest(), digest_size=16).hexdigest()
