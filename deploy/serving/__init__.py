"""Serving: what answers users and records what it answered.

    serve.py + serve_api.py      rtrl serve: the policy (champion, canary's share) behind an
                                 OpenAI-compatible API, on the local model
    gateway.py + gateway_api.py  rtrl gateway: the same API in front of another server (vLLM,
                                 SGLang, rtrl serve), routing to the registry's versions
      gateway_body / _record / _sampling   its request bodies, its record of an answer, what it
                                 keeps of the upstream's sampling and log-probs
    routing.py                   which version answers a request (the router decides, never the client)
    follow.py                    the registry's moves, followed from the model-updates topic
    vllm.py                      keeps a vLLM server's LoRA adapters on the registry's versions
    events.py                    the events serving sends, through a spool while Kafka is away

It reads the registry (deploy/registry_read.py) and imports nothing else of deploy/: neither the
gate nor the registry's writes, and nothing else in deploy/ imports it (import-linter checks
both); the model it serves is loaded by whoever starts it (rtrl serve hands it a runner).
"""
