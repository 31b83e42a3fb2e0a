"""`rtrl demo`: the whole loop on a laptop, on embedded defaults, in a few minutes.

    1. a local Kafka broker, a SQLite store and an MLflow store under the state folder; the
       run's settings in <state>/demo/rtrl.toml (pipeline/demo/config.py)
    2. a tiny base model, warmed up to copy more often than it reverses (mediocre, not hopeless)
    3. `rtrl serve` in its own process, as next to a real daemon: it answers with the
       champion and follows the registry (its log: <state>/demo/serve.log); with `gateway`,
       `rtrl gateway` in front of it captures the traffic and routes the canary's share, as in
       front of vLLM (<state>/demo/gateway.log)
    4. the daemon (in this process): ingest, and a cycle every `--every`
    5. the simulated fleet (pipeline/demo/sim.py) sending tasks and reacting with delays
    6. a candidate that passes the gate serves half the requests as the canary, and the users'
       reactions decide its promotion (deploy/rollout.py)
    7. after N cycles that reached a decision: a report (pipeline/demo/report.py) in
       <state>/demo/report and in MLflow, and the commands that look around what the run did

The terminal shows a progress line and one line per decision; the structured logs go to
<state>/demo/demo.log (`verbose` shows them instead). `--naive-reward` swaps in a spec with no
abstention penalty: abstaining draws no complaint, so it pays better than a wrong attempt on
hard tasks; the gate's canaries must catch the candidate that learns it.

`task="agent"` runs the agent task family instead (pipeline/demo/agent.py): episodes of tool
calls and a final answer, rewarded by the episode's outcome, in <state>/demo-agent[-naive];
there `--naive-reward` lets a broken tool call cost nothing, and the tool-format canaries (the
gate's and the staged rollout's) must refuse the candidate that learns to write them.
"""

from __future__ import annotations

import logging
import shutil
import time
import uuid
from pathlib import Path

from pipeline.core.logs import JsonFormatter
from pipeline.demo.config import base_dir, build_base, demo_config, run_dir_name, write_config
from pipeline.demo.fleet import Terminal, run_fleet, start_server, stop_server
from pipeline.demo.report import DemoReport, collect, write_report


def log_to_file(path: Path) -> None:
    """Structured logs and library warnings to `path`, not the terminal."""
    handler = logging.FileHandler(path)
    handler.setFormatter(JsonFormatter())
    logging.getLogger().handlers[:] = [handler]
    logging.captureWarnings(True)  # (a library's FutureWarning is a log line, not a newcomer's concern)


def explore_commands(config_file: Path, tracking_uri: str, report: DemoReport, request_id: str | None) -> list[str]:
    """The commands that look around what the run did, with its settings."""
    rtrl = f"rtrl --config {config_file}"
    version = report.decisions[-1]["candidate"] if report.decisions else None  # the newest registered
    lines = [f"{rtrl} status", f"{rtrl} models list"]
    if version is not None:
        lines.append(f"{rtrl} models show {version}")
    lines += [f"{rtrl} reward audit"]
    if request_id is not None:
        lines.append(f"{rtrl} reward explain {request_id}")
    lines += [f"{rtrl} train show", f"mlflow ui --backend-store-uri {tracking_uri}"]
    return lines


def run_demo(
    state_dir: Path,
    config_path: str | Path | None = None,
    cycles: int = 5,
    naive: bool = False,
    seed: int = 0,
    rate: float = 24.0,
    every: str = "45s",
    timeout_s: float = 900.0,
    measure: int = 200,
    verbose: bool = False,
    terminal: Terminal | None = None,
    gateway: bool = False,
    task: str = "reverse",
) -> DemoReport:
    """Run the demo in `<state_dir>/demo[-agent][-naive]` (wiped first); the report lands in its
    `report/`."""
    from deploy.registry import CHAMPION
    from deploy.tracking import MlflowTracker
    from pipeline import kafka_local
    from pipeline.core.store import db as store_db
    from pipeline.core.store.rewards import latest_request_id
    from pipeline.cycle import default_deps
    from pipeline.daemon import Daemon
    from reward.spec import load_spec

    terminal = terminal or Terminal()
    t0 = time.monotonic()
    run_dir = state_dir / run_dir_name(task, naive)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    if not verbose:
        log_to_file(run_dir / "demo.log")
        terminal.say(f"logs: {run_dir / 'demo.log'} (JSON lines; --verbose shows them here)")
    config = demo_config(config_path, state_dir, run_dir, naive, every, seed, tag=uuid.uuid4().hex[:8], task=task)
    broker = kafka_local.up(config, progress=terminal.say)
    config.kafka.security = broker.access().security  # a local broker set up --secure: its users and CA
    config_file = write_config(config, run_dir / "rtrl.toml")
    kafka_local.ensure_topics(
        config.kafka_access,
        [config.kafka.interactions_topic, config.kafka.feedback_topic, config.kafka.model_updates_topic],
        config.kafka.partitions,
    )
    store_db.upgrade(config.db_url)
    engine = store_db.make_engine(config.db_url)
    base = config.train.base_model
    if base == base_dir(state_dir, task):  # the demo's own; a base model the user set is used as it is
        if task == "agent":
            from pipeline.demo.agent_base import build_agent_base

            build_agent_base(base, seed, terminal.say)
        else:
            build_base(base, seed, terminal.say)
    spec = load_spec(config.reward.spec)
    deps = default_deps(config, engine, spec)

    deps.registry.alias(CHAMPION)  # creates the MLflow store's tables before the server reads them
    # serving: the champion, following the registry (the base until the first promotion)
    servers, url = start_server(config, base, run_dir, gateway=gateway)
    try:
        daemon = Daemon(config, deps, lease_ttl_s=30)
        daemon.start(ingest=True, metrics_port=None)
        try:
            champion = run_fleet(
                config, engine, url, daemon, cycles, measure, rate, seed, every, timeout_s, t0, terminal, gateway, task
            )
        finally:
            daemon.shutdown()
    finally:
        stop_server(servers)

    report = collect(engine, spec.version, config.mlflow.registered_model, champion, time.monotonic() - t0, task)
    report.files = write_report(report, run_dir / "report", naive)
    tracker = MlflowTracker(config.tracking_uri, config.mlflow.experiment, config.artifact_root, run_name="demo-report")
    tracker.log_params(
        {"task": task, "naive_reward": naive, "seed": seed, "cycles": cycles, "rate": rate, "every": every}
    )
    for v in report.versions:
        if v["version"].isdigit():
            tracker.log_metrics(
                {"episode_success_rate" if task == "agent" else "accept_rate": v["accept_rate"]}, step=int(v["version"])
            )
    tracker.log_artifacts(run_dir / "report", "report")
    tracker.end("FINISHED")
    report.explore = explore_commands(config_file, config.tracking_uri, report, latest_request_id(engine))
    return report
