"""What `rtrl gateway` costs: requests/s and latency through the gateway against the same
requests sent straight to its upstream, at 1, 16 and 64 concurrent clients, streamed and not.

The upstream answers at once (a vLLM-shaped answer with log-probs and token ids from
tests/support/fixtures/vllm_chat_completion.json; streamed as 4 chunks and [DONE]), so what differs is
the gateway's own work: routing, asking for log-probs, reshaping the answer to what the client
asked for, and building and handing off the interaction event. Upstream and gateway are uvicorn
processes of their own; the load comes from this process (asyncio + httpx, one connection pool
per run, aiohttp). Events go to a counter in the gateway process (read back from its /metrics: every
request must have produced one) -- or, with --bootstrap, through the spool-backed Kafka sender
`rtrl gateway` uses to a real broker.

    .venv/bin/python benchmarks/gateway.py                       # 1, 16, 64 clients; 5 s each
    .venv/bin/python benchmarks/gateway.py --concurrency 16 --seconds 2    # a smoke run
    .venv/bin/python benchmarks/gateway.py --bootstrap 127.0.0.1:9092      # events to Kafka
    .venv/bin/python benchmarks/gateway.py --null-proxy    # a pass-through proxy in its place: the floor
    .venv/bin/python benchmarks/gateway.py --litellm /tmp/llmvenv/bin/litellm
        # LiteLLM's proxy (`pip install 'litellm[proxy]'` into a virtual environment of its own: it
        # pins its own FastAPI and pydantic) in its place, forwarding to the same upstream

Prints, per configuration, requests/s direct and through the gateway (ratio), p50/p99 latency
of each and what the gateway added. Targets on 2 cores: added p99 <= 5 ms at 16 clients, ratio
>= 0.7, an event for every request -- and against LiteLLM's proxy (--litellm), a higher
throughput and a lower added p50/p99 at 1, 16 and 64 clients, streamed and not.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ASK = {"model": "policy", "messages": [{"role": "user", "content": "reverse the string abc"}], "max_tokens": 3}
LITELLM_KEY = "sk-rtrl-bench-0123456789abcdef0123456789abcdef"  # its proxy refuses to start without one
HEADERS: dict[str, str] = {}  # what every request carries (LiteLLM's key, when it is measured)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_upstream(port: int) -> None:
    import uvicorn

    from tests.support.vllm_instant import instant_vllm_app

    uvicorn.run(instant_vllm_app(), host="127.0.0.1", port=port, log_level="error", access_log=False)


def _serve_gateway(port: int, upstream: str, bootstrap: str | None, spool: str | None) -> None:
    import uvicorn

    from deploy.serving.gateway import Gateway
    from deploy.serving.gateway_api import create_gateway_app

    emit = None
    if bootstrap:
        from deploy.serving.events import EventSender
        from pipeline.core.spool import Spool

        emit = EventSender(bootstrap, "rtrl-bench.interactions", key="request_id", spool=Spool(Path(spool)))
    else:

        def emit(event: dict) -> None:  # counted by the gateway's own metric: events sent
            pass

    gw = Gateway(upstream, "policy", emit, None)
    uvicorn.run(create_gateway_app(gw), host="127.0.0.1", port=port, log_level="error", access_log=False)


def _null_proxy_app(upstream: str):
    """The floor for any proxy written like the gateway (uvicorn + aiohttp in Python): a raw ASGI
    app that passes each request's bytes to the upstream and the answer's bytes back -- no
    routing, no JSON, no event."""
    import aiohttp

    from tests.support.vllm_instant import read_body

    sessions: dict = {}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        raw = await read_body(receive)
        session = sessions.get("s")
        if session is None:
            session = sessions["s"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        async with session.post(
            upstream + scope["path"], data=raw, headers={"Content-Type": "application/json"}
        ) as answer:
            await send(
                {
                    "type": "http.response.start",
                    "status": answer.status,
                    "headers": [(b"content-type", answer.headers["content-type"].encode())],
                }
            )
            await send({"type": "http.response.body", "body": await answer.read()})

    return app


def _serve_null_proxy(port: int, upstream: str) -> None:
    import uvicorn

    uvicorn.run(_null_proxy_app(upstream), host="127.0.0.1", port=port, log_level="error", access_log=False)


def _start_litellm(binary: str, port: int, upstream: str, workdir: Path):
    """LiteLLM's proxy on `port`, the model "policy" forwarded to the upstream as an OpenAI-compatible
    server (as a team puts it in front of vLLM); its logs in workdir/litellm.log."""
    import subprocess

    config = workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n  - model_name: policy\n    litellm_params:\n      model: openai/policy\n"
        f"      api_base: {upstream}/v1\n      api_key: unused\n"
        "litellm_settings:\n  drop_params: true\n  telemetry: false\n"
        f"general_settings:\n  master_key: {LITELLM_KEY}\n"
    )
    log = open(workdir / "litellm.log", "wb")
    return subprocess.Popen(
        [binary, "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _wait(url: str, deadline_s: float = 60) -> None:
    import requests

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            if requests.post(url + "/v1/chat/completions", json=ASK, headers=HEADERS, timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)  # polling a server's start, with a deadline
    raise RuntimeError(f"{url} did not start in {deadline_s} s")


async def _load(url: str, clients: int, seconds: float, stream: bool) -> tuple[int, list[float]]:
    """(requests completed, their latencies in seconds) from `clients` concurrent loops."""
    import aiohttp

    body = {**ASK, "stream": stream}
    latencies: list[float] = []
    connector = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(url, connector=connector) as http:
        end = time.perf_counter() + seconds

        async def one_client() -> None:
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                async with http.post("/v1/chat/completions", json=body, headers=HEADERS) as answer:
                    await answer.read()  # the whole answer: every chunk of a stream
                    assert answer.status == 200, await answer.text()
                latencies.append(time.perf_counter() - t0)

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return int(len(latencies) / elapsed * 1000) / 1000, latencies  # requests/s


def _events_sent(gateway: str) -> float:
    import requests

    answer = requests.get(gateway + "/metrics")
    for line in answer.text.splitlines() if answer.ok else ():
        if line.startswith('rtrl_gateway_events_total{outcome="sent",type="interaction"}'):
            return float(line.split()[-1])
    return 0.0


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) >= 2 else values[0] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--seconds", type=float, default=5.0, help="load per configuration and target")
    ap.add_argument("--bootstrap", help="send the events to this Kafka broker (spooled) instead of a counter")
    ap.add_argument(
        "--null-proxy",
        action="store_true",
        help="measure a pass-through proxy in the gateway's place (the floor of its design) instead",
    )
    ap.add_argument(
        "--litellm",
        metavar="BIN",
        help="measure LiteLLM's proxy (this `litellm` executable) in the gateway's place instead",
    )
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    up_port, gw_port = _free_port(), _free_port()
    upstream, gateway = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{gw_port}"
    spool = str(Path(__import__("tempfile").mkdtemp(prefix="rtrl-bench-gw-")) / "spool")
    procs = [ctx.Process(target=_serve_upstream, args=(up_port,), daemon=True)]
    if args.null_proxy:
        procs.append(ctx.Process(target=_serve_null_proxy, args=(gw_port, upstream), daemon=True))
    elif not args.litellm:
        procs.append(ctx.Process(target=_serve_gateway, args=(gw_port, upstream, args.bootstrap, spool), daemon=True))
    for p in procs:
        p.start()
    if args.litellm:
        procs.append(_start_litellm(args.litellm, gw_port, upstream, Path(spool).parent))
        HEADERS["Authorization"] = f"Bearer {LITELLM_KEY}"
    no_events = args.null_proxy or args.litellm
    try:
        _wait(upstream)
        _wait(gateway, 180)
        print(
            f"{'clients':>7} {'stream':>6} | {'direct r/s':>10} {'gateway r/s':>11} {'ratio':>5} | "
            f"{'p50 direct':>10} {'p50 gw':>7} {'p99 direct':>10} {'p99 gw':>7} | {'added p50':>9} {'added p99':>9}"
            f" | events"
        )
        for clients in args.concurrency:
            for stream in (False, True):
                before = _events_sent(gateway)
                asyncio.run(_load(gateway, clients, 0.5, stream))  # warm both paths' connections
                asyncio.run(_load(upstream, clients, 0.5, stream))
                before = _events_sent(gateway)
                direct_rps, direct = asyncio.run(_load(upstream, clients, args.seconds, stream))
                gw_rps, through = asyncio.run(_load(gateway, clients, args.seconds, stream))
                deadline = time.monotonic() + (0 if no_events else 30)
                while _events_sent(gateway) - before < len(through) and time.monotonic() < deadline:
                    time.sleep(0.05)  # the sender thread hands events off after the answers
                events = int(_events_sent(gateway) - before)
                p50d, p50g, p99d, p99g = _pct(direct, 50), _pct(through, 50), _pct(direct, 99), _pct(through, 99)
                print(
                    f"{clients:>7} {'yes' if stream else 'no':>6} | {direct_rps:>10.0f} {gw_rps:>11.0f} "
                    f"{gw_rps / direct_rps:>5.2f} | {p50d:>8.2f}ms {p50g:>5.2f}ms {p99d:>8.2f}ms {p99g:>5.2f}ms | "
                    f"{p50g - p50d:>7.2f}ms {p99g - p99d:>7.2f}ms | {events}/{len(through)}",
                    flush=True,
                )
    finally:
        for p in procs:
            p.terminate()
            p.join(5) if hasattr(p, "join") else p.wait(5)


if __name__ == "__main__":
    main()
