"""Serving: what answers users and records what it answered.

    start.py                     what the commands call: serve_policy, keep_vllm, run_gateway, each
                                 given one job (ServeJob, GatewayJob), in the order it starts things
    serve.py                     rtrl serve: the policy (champion, canary's share) on the local model
      serve_api.py               its OpenAI-compatible routes
      serve_requests.py, serve_answers.py   the bodies they accept, the answers they write (whole or streamed)
    gateway.py                   rtrl gateway: the same API in front of another server (vLLM,
                                 SGLang, rtrl serve), routing to the registry's versions
      gateway_api.py             its routes
      gateway_forward.py         one request forwarded, its answer relayed, its events kept
      gateway_body / _record / _sampling   a request's body, the record of an answer, what it
                                 asks of the upstream's sampling and log-probs
    routing.py                   which version answers a request (the router decides, never the client)
    follow.py                    the registry's moves, followed from the model-updates topic
    vllm.py                      keeps a vLLM server's LoRA adapters on the registry's versions
    events.py                    the events serving sends, through a spool while Kafka is away

It reads the registry (deploy/registry_read.py) and imports nothing else of deploy/: neither the
gate nor the registry's writes, and nothing else in deploy/ imports it (import-linter checks
both); the model it serves is loaded by whoever starts it (rtrl serve hands it a loader,
ServeJob.load_policy, and serving calls it with the base model's directory).
"""
