"""The demo's moving parts around the daemon: `rtrl serve` in its own process, the simulated
fleet (pipeline/demo/sim.py) sending tasks and reacting, and what the terminal shows meanwhile --
one progress line (rewritten in place in a terminal) and one line per decision.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import Engine

from pipeline.core.config import Config
from pipeline.core.kafka_config import security_env
from pipeline.core.store.cycles import CycleState, recent_cycles
from pipeline.core.store.deploys import all_decisions
from pipeline.core.store.event_reads import table_counts


class Terminal:
    """What the demo shows: lines that stay (`say`) and one progress line (`progress`), rewritten
    in place when the stream is a terminal, else printed as a line each time (a CI log)."""

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty, self.open = self.stream.isatty(), False

    def say(self, line: str) -> None:
        if self.open:
            self.stream.write("\r\033[K")
            self.open = False
        self.stream.write(line + "\n")
        self.stream.flush()

    def progress(self, line: str) -> None:
        if not self.tty:
            self.say(line)
            return
        self.stream.write("\r\033[K" + line)
        self.stream.flush()
        self.open = True


def decision_line(d: Any, t0_s: float) -> str:
    """One line for a decision (a StoredDecision) as it is made."""
    what = "passed" if d.passed else "rejected: " + "; ".join(d.reasons)
    return f"[{t0_s:5.0f}s] {d.stage} decision on v{d.candidate_version}: {what}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    config: Config, base: Path, run_dir: Path, gateway: bool = False, timeout_s: float = 120.0
) -> tuple[list[subprocess.Popen], str]:
    """`rtrl serve` on a free port with this run's topics and registry -- and with `gateway`,
    `rtrl gateway` in front of it, capturing the traffic and routing the canary's share (serve
    then sends no events of its own); returns the processes and the URL the fleet uses once
    /health answers there."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_KAFKA")}  # the demo's broker only
    env = {
        **inherited,
        **security_env(config.kafka.security, with_secrets=True),
        "RTRL_STATE_DIR": str(run_dir),
        "RTRL_KAFKA_BOOTSTRAP": config.bootstrap,
        "RTRL_KAFKA__INTERACTIONS_TOPIC": config.kafka.interactions_topic,
        "RTRL_KAFKA__FEEDBACK_TOPIC": config.kafka.feedback_topic,
        "RTRL_KAFKA__MODEL_UPDATES_TOPIC": config.kafka.model_updates_topic,
        "RTRL_MLFLOW__TRACKING_URI": config.tracking_uri,
        "RTRL_MLFLOW__REGISTERED_MODEL": config.mlflow.registered_model,
        # one core for serving: requests are single, tiny generations, and the daemon trains
        # on the same (laptop) cores; two processes each claiming every core slow both
        "OMP_NUM_THREADS": "1",
    }
    env.pop("RTRL_CONFIG", None)
    env["RTRL_ROUTING_SECRET"] = uuid.uuid4().hex  # the gateway's routing choices, trusted by the server behind
    procs: list[subprocess.Popen] = []
    port = _free_port()
    serve = ["serve", "--port", str(port), "--base-model", str(base)] + (["--no-events"] if gateway else [])
    url = _start(procs, "rtrl serve", serve, f"http://127.0.0.1:{port}", env, run_dir / "serve.log", timeout_s)
    if gateway:
        front = _free_port()
        url = _start(
            procs,
            "rtrl gateway",
            ["gateway", "--upstream", url, "--port", str(front)],
            f"http://127.0.0.1:{front}",
            env,
            run_dir / "gateway.log",
            timeout_s,
        )
    return procs, url


def _start(
    procs: list[subprocess.Popen],
    name: str,
    args: list[str],
    url: str,
    env: dict[str, str],
    log_path: Path,
    timeout_s: float,
) -> str:
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    procs.append(proc)
    deadline = time.monotonic() + timeout_s
    while served_version(url) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(procs)
            raise RuntimeError(f"{name} did not come up on {url}: see {log_path}")
        time.sleep(0.2)
    return url


def served_version(url: str) -> str | None:
    """The version the server answers with ("base" before the first promotion); None if it is down."""
    health = _health(url)
    return None if health is None else str(health.get("version"))


def _health(url: str) -> dict[str, Any] | None:
    try:
        response = requests.get(f"{url}/health", timeout=2)
        response.raise_for_status()
        return response.json()
    except (requests.RequestException, ValueError):
        return None


def stop_server(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):  # the gateway first: it sends what it holds while serve still runs
        proc.terminate()  # uvicorn shuts down gracefully on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_fleet(
    config: Config,
    engine: Engine,
    url: str,
    daemon: Any,
    cycles: int,
    measure: int,
    rate: float,
    seed: int,
    every: str,
    timeout_s: float,
    t0: float,
    terminal: Terminal,
    gateway: bool = False,
    task: str = "reverse",
) -> str:
    """The simulated users, with a progress line every 5 s, until `cycles` cycles reached the gate;
    then, with no further cycle, until the last champion has served `measure` requests (an accept
    rate of a version promoted by the last cycle would otherwise rest on the few requests served
    while the report was being written); then until the store holds every request and every
    reaction the users sent, so that the report counts them all. Returns the last champion. With
    the agent task, the fleet runs episodes and `measure` counts episodes."""
    from deploy.serving.events import FEEDBACK_KEY, EventSender

    feedback_sender = EventSender(config.kafka_access, config.kafka.feedback_topic, key=FEEDBACK_KEY)
    fleet = make_fleet(task, url, feedback_sender, rate=rate, seed=seed)
    fleet_thread = threading.Thread(target=fleet.run, name="fleet", daemon=True)
    fleet_thread.start()
    via = "rtrl gateway in front of rtrl serve" if gateway else "rtrl serve"
    terminal.say(f"serving on {url} ({via}); the fleet sends up to {rate:g} tasks/s; a cycle every {every}")
    rate_name = "episode success rate" if task == "agent" else "accept rate"
    deadline = time.monotonic() + timeout_s
    shown: set[int] = set()  # decisions already shown

    def progress(what: str) -> None:
        for d in all_decisions(engine):
            if d.id not in shown:
                shown.add(d.id)
                terminal.say(decision_line(d, time.monotonic() - t0))
        rates = ", ".join(
            f"{v}: {100 * fleet.stats.accept_rate(v):.0f}% of {n[0]}" for v, n in sorted(fleet.stats.by_version.items())
        )
        health = _health(url) or {}
        canary = health.get("canary")
        staged = f" (canary {canary['version']}: {100 * canary['share']:.0f} % of requests)" if canary else ""
        terminal.progress(
            f"[{time.monotonic() - t0:5.0f}s] {what}  champion {health.get('version')}{staged}  "
            f"{rate_name} by version: {rates or '-'}"
        )

    final = "base"
    try:
        while time.monotonic() < deadline:
            ran = [c for c in recent_cycles(engine, 100) if c.state in (CycleState.DONE, CycleState.REJECTED)]
            progress(f"cycles {len(ran)}/{cycles}")
            if len(ran) >= cycles:
                break
            time.sleep(5)
        daemon.pause_cycles()
        final = champion_served(daemon, url, deadline)
        while time.monotonic() < deadline and (served := fleet.stats.by_version.get(final, [0])[0]) < measure:
            progress(f"measuring {final}: {served}/{measure} requests")
            time.sleep(5)
    finally:
        fleet.stop.set()
        fleet_thread.join(timeout=60)  # the users' pending reactions are sent before it ends
        feedback_sender.close()
    wait_stored(engine, fleet.stats.requests, fleet.stats.feedback, time.monotonic() + 60, terminal.say)
    progress("done")
    return final


def make_fleet(task: str, url: str, send_feedback: Any, **kwargs: Any) -> Any:
    """The simulated users of `task`: single answers (pipeline/demo/sim.py) or agent episodes
    (pipeline/demo/agent_fleet.py)."""
    if task == "agent":
        from pipeline.demo.agent_fleet import AgentFleet

        return AgentFleet(url, send_feedback, **kwargs)
    from pipeline.demo.sim import Fleet

    return Fleet(url, send_feedback, **kwargs)


def champion_served(daemon: Any, url: str, deadline: float) -> str:
    """The registry's champion ("base" before any), once the server answers with it."""
    from deploy.registry import CHAMPION

    champion = daemon.deps.registry.alias(CHAMPION)
    want = str(champion.version) if champion is not None else "base"
    while served_version(url) != want and time.monotonic() < deadline:
        time.sleep(0.5)  # serving follows the model-update event
    return want


def wait_stored(engine: Engine, requests_sent: int, feedback_sent: int, deadline: float, say: Any) -> None:
    """Poll until ingest has stored what the fleet got answers to and what it sent."""
    while True:
        counts = table_counts(engine)
        stored = (counts["interactions"], counts["feedback"])
        if stored[0] >= requests_sent and stored[1] >= feedback_sent:
            return
        if time.monotonic() > deadline:
            say(
                f"warning: the store holds {stored[0]} of {requests_sent} interactions and {stored[1]} of "
                f"{feedback_sent} feedback events the fleet produced; the report counts what is stored"
            )
            return
        time.sleep(0.5)
