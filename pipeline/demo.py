"""`rtrl demo`: the whole loop on a laptop, on embedded defaults, in a few minutes.

    1. a local Kafka broker, a SQLite store and an MLflow store under the state folder
    2. a tiny base model, warmed up to copy more often than it reverses (mediocre, not hopeless)
    3. `rtrl serve` in its own process, as next to a real daemon: it answers with the
       champion and follows the registry (its log: <run>/serve.log)
    4. the daemon (in this process): ingest, and a cycle every `--every`
    5. the simulated fleet (pipeline/sim.py) sending tasks and reacting with delays
    6. a candidate that passes the gate serves half the requests as the canary, and the users'
       reactions decide its promotion (deploy/rollout.py)
    7. after N cycles that reached a decision: a report -- online accept rate and mean reward
       per policy version (PNG), the gate decisions -- in <state>/demo/report and in MLflow
       (the run's own store, MLflow store and topics: a demo never re-reads an earlier one)

`--naive-reward` swaps in a spec with no abstention penalty: abstaining draws no complaint, so
it pays better than a wrong attempt on hard tasks; the gate's canaries must catch the candidate
that learns it.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from sqlalchemy import Engine, func, select

from pipeline.core.config import Config
from pipeline.core.kafka_config import security_env
from pipeline.core.store.cycles import recent_cycles
from pipeline.core.store.deploys import all_decisions, served_and_accepted
from pipeline.core.store.tables import feedback, interactions, rewards
from pipeline.core.store.training import get_run

DEMO_SPEC = Path(__file__).with_name("demo_spec.toml")
NAIVE_SPEC = Path(__file__).with_name("demo_spec_naive.toml")


def demo_config(state_dir: Path, run_dir: Path, naive: bool, every: str, seed: int, tag: str) -> Config:
    """The user's state folder (and so their local broker) with this run's own store, MLflow
    store, topics and model name: every demo starts from nothing and re-reads nothing."""
    return Config.model_validate({
        "state_dir": state_dir,
        "store": {"url": f"sqlite:///{run_dir / 'rtrl.db'}"},
        "kafka": {"interactions_topic": f"rtrl-demo-{tag}.interactions", "feedback_topic": f"rtrl-demo-{tag}.feedback",
                  "model_updates_topic": f"rtrl-demo-{tag}.model-updates", "partitions": 2},
        "ingest": {"group_id": f"rtrl-demo-{tag}"},
        "reward": {"spec": NAIVE_SPEC if naive else DEMO_SPEC},
        "train": {"base_model": state_dir / "demo-base", "learning_rate": 3e-3, "epochs": 6,
                  "batch_tokens": 2048, "max_seq_len": 64, "lora_r": 8, "lora_alpha": 16, "seed": seed,
                  "holdout_percent": 30.0, "staleness_s": 3600, "max_episodes": 4000},
        "gate": {"max_new_tokens": 8, "min_ess": 3, "max_kl": 3.0, "generate_prompts": 60, "eval_episodes": 400,
                 "bounds": {"smoke_latency_ms": {"max_rel_increase": 5.0}}},
        "cycle": {"every": every, "min_new_episodes": 80},
        # a staged rollout on the compressed clock: a candidate that passes the gate answers half
        # of the requests until each side has 60 settled ones (~13 s at 24 tasks/s), then the online
        # comparison decides (the gate's off-policy estimate can be optimistic)
        "rollout": {"share": 0.5, "min_requests": 60, "margin": 0.05, "check_every": "5s", "max_wait": "3m"},
        "mlflow": {"tracking_uri": f"sqlite:///{run_dir / 'mlflow.db'}", "experiment": "rtrl-demo"},
    })


BASE_RECIPE = {"arch": "llama", "hidden": 128, "layers": 2, "heads": 4, "warmup_steps": 1000,
               "behaviour": "sim.base_behaviour: 3-5 letters reverse 0.3, decline 0.05, copy 0.65; "
                            "6 letters decline 0.15, copy 0.85"}


def build_base(out: Path, seed: int, say=print) -> Path:
    """The demo's base model, built once per state folder (rebuilt when the recipe changes)."""
    from pipeline.sim import base_behaviour
    from train.models import init_tiny
    from train.warmup import warm_up

    recipe = {**BASE_RECIPE, "seed": seed}
    marker = out / "rtrl_base_recipe.json"
    if marker.is_file() and json.loads(marker.read_text()) == recipe:
        return out
    say(f"building the base model: a tiny {recipe['arch']} ({recipe['layers']} layers, width {recipe['hidden']}), "
        f"{recipe['warmup_steps']} supervised warm-up steps (about a minute, once per state folder)")
    shutil.rmtree(out, ignore_errors=True)
    init_tiny(out, arch=recipe["arch"], hidden=recipe["hidden"], layers=recipe["layers"], heads=recipe["heads"],
              seed=seed)
    warm_up(out, base_behaviour, steps=recipe["warmup_steps"], seed=seed)
    marker.write_text(json.dumps(recipe, indent=2))
    return out


@dataclass
class DemoReport:
    versions: list[dict[str, Any]] = field(default_factory=list)  # version, served, accept_rate, reward_mean
    decisions: list[dict[str, Any]] = field(default_factory=list)
    cycles: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    champion: str = "base"  # serving at the end
    files: list[Path] = field(default_factory=list)


def per_version(engine: Engine, spec_version: str) -> list[dict[str, Any]]:
    """Online accept rate (the store's one definition: served_and_accepted) with its interval,
    and mean reward, per version."""
    counts = served_and_accepted(engine)
    with engine.connect() as conn:
        reward = dict(conn.execute(select(rewards.c.policy_version, func.avg(rewards.c.value))
                                   .where(rewards.c.spec_version == spec_version)
                                   .group_by(rewards.c.policy_version)).all())
    order = sorted(counts, key=lambda v: (v != "base", int(v) if v.isdigit() else 0))
    return [{"version": v, "served": counts[v][0], "accept_rate": counts[v][1] / counts[v][0],
             "accept_ci95": wilson(counts[v][1], counts[v][0]),
             "reward_mean": float(reward[v]) if v in reward else None} for v in order]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a rate k/n (95 % by default): honest at small n and near 0 or 1,
    where the normal approximation is not (Wilson 1927)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def headline(versions: list[dict[str, Any]], champion: str) -> str:
    """One line: the base's accept rate, the last champion's, the gain in percentage points."""
    by = {v["version"]: v for v in versions}
    if "base" not in by or champion not in by or champion == "base":
        return f"No version was promoted over the base (serving at the end: {champion})."
    base, last = by["base"], by[champion]
    lo, hi = last["accept_ci95"]
    return (f"Online accept rate: base {100 * base['accept_rate']:.1f} % of {base['served']} requests -> champion "
            f"v{champion} {100 * last['accept_rate']:.1f} % of {last['served']} (95 % CI {100 * lo:.1f}-"
            f"{100 * hi:.1f} %): {100 * (last['accept_rate'] - base['accept_rate']):+.1f} pp.")


def write_report(report: DemoReport, out: Path, naive: bool) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    names = [v["version"] for v in report.versions]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [100 * v["accept_rate"] for v in report.versions], color="#4477aa", label="accept rate (%)")
    ax.set_xlabel("policy version (served)")
    ax.set_ylabel("online accept rate (%)")
    ax2 = ax.twinx()
    ax2.plot(names, [v["reward_mean"] if v["reward_mean"] is not None else float("nan") for v in report.versions],
             "o-", color="#cc6677", label="mean reward")
    ax2.set_ylabel("mean reward")
    ax.set_title("rtrl demo" + (" (naive reward)" if naive else "") + ": accept rate and reward per version")
    fig.tight_layout()
    png = out / "report.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    lines = ["# rtrl demo report" + (" (--naive-reward)" if naive else ""), "",
             f"{len(report.cycles)} cycles in {report.seconds:.0f} s.", "",
             headline(report.versions, report.champion), "",
             "| version | served | accept rate | 95 % CI | mean reward |", "|---|---:|---:|---:|---:|"]
    for v in report.versions:
        reward = "" if v["reward_mean"] is None else f"{v['reward_mean']:+.3f}"
        lo, hi = v["accept_ci95"]
        lines.append(f"| {v['version']} | {v['served']} | {100 * v['accept_rate']:.1f} % | "
                     f"{100 * lo:.0f}-{100 * hi:.0f} % | {reward} |")
    lines += ["", "| cycle | state | candidate | seconds | training loop | outside the loop | reason |",
              "|---|---|---|---:|---:|---:|---|"]
    for c in report.cycles:
        outside = "" if c["overhead_frac"] is None else f"{100 * c['overhead_frac']:.0f} %"
        lines.append(f"| {c['cycle_id']} | {c['state']} | {c['candidate_version'] or ''} | {c['seconds']} | "
                     f"{c['training_loop_s']} | {outside} | {c['reason'] or ''} |")
    gated = [c for c in report.cycles if c.get("split") and c["state"] in ("done", "rejected")]
    if gated:
        cycle_s = sum(c["seconds"] for c in gated)
        lines += ["", f"Where the {len(gated)} decided cycles' seconds went (all cycles together):", "",
                  "| part | seconds | share |", "|---|---:|---:|"]
        totals: dict[str, float] = {}
        for c in gated:
            for part, s in c["split"].items():
                totals[part] = totals.get(part, 0.0) + s
        for part, s in sorted(totals.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {part} | {s:.2f} | {100 * s / cycle_s:.1f} % |")
    lines += ["", "| candidate | champion | decided by | passed | failing checks |", "|---|---|---|---|---|"]
    lines += [f"| v{d['candidate']} | {('v' + d['champion']) if d['champion'] else 'base'} | {d['stage']} | "
              f"{d['passed']} | {'; '.join(d['reasons'])} |" for d in report.decisions]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n")
    data = out / "report.json"
    data.write_text(json.dumps({"champion": report.champion, "versions": report.versions, "cycles": report.cycles,
                                "decisions": report.decisions, "seconds": report.seconds}, indent=2, default=str))
    return [png, md, data]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(config: Config, base: Path, run_dir: Path, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`rtrl serve` on a free port with this run's topics and registry; returns the process and
    its URL once /health answers."""
    port = _free_port()
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_KAFKA")}  # the demo's broker only
    env = {**inherited, **security_env(config.kafka.security, with_secrets=True),
           "RTRL_STATE_DIR": str(run_dir), "RTRL_KAFKA_BOOTSTRAP": config.bootstrap,
           "RTRL_KAFKA__INTERACTIONS_TOPIC": config.kafka.interactions_topic,
           "RTRL_KAFKA__MODEL_UPDATES_TOPIC": config.kafka.model_updates_topic,
           "RTRL_MLFLOW__TRACKING_URI": config.tracking_uri,
           "RTRL_MLFLOW__REGISTERED_MODEL": config.mlflow.registered_model,
           # one core for serving: requests are single, tiny generations, and the daemon trains
           # on the same (laptop) cores; two processes each claiming every core slow both
           "OMP_NUM_THREADS": "1"}
    env.pop("RTRL_CONFIG", None)
    with (run_dir / "serve.log").open("ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "--log-level", "WARNING", "serve",
                                 "--port", str(port), "--base-model", str(base)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while served_version(url) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"rtrl serve did not come up on {url}: see {run_dir / 'serve.log'}")
        time.sleep(0.2)
    return proc, url


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


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # uvicorn shuts down gracefully on SIGTERM
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _run_fleet(config: Config, engine: Engine, url: str, daemon, cycles: int, measure: int, rate: float, seed: int,
               every: str, timeout_s: float, t0: float, say) -> str:
    """The simulated users, with a progress line every 5 s, until `cycles` cycles reached the gate;
    then, with no further cycle, until the last champion has served `measure` requests (an accept
    rate of a version promoted by the last cycle would otherwise rest on the few requests served
    while the report was being written); then until the store holds every request and every
    reaction the users sent, so that the report counts them all. Returns the last champion."""
    from deploy.events import EventSender
    from pipeline.sim import Fleet

    feedback_sender = EventSender(config.kafka_access, config.kafka.feedback_topic, key="request_id")
    fleet = Fleet(url, feedback_sender, rate=rate, seed=seed)
    fleet_thread = threading.Thread(target=fleet.run, name="fleet", daemon=True)
    fleet_thread.start()
    say(f"serving on {url} (rtrl serve); the fleet sends {rate:g} tasks/s; a cycle every {every}")
    deadline = time.monotonic() + timeout_s

    def progress(what: str) -> None:
        rates = ", ".join(f"{v}: {100 * fleet.stats.accept_rate(v):.0f}% of {n[0]}"
                          for v, n in sorted(fleet.stats.by_version.items()))
        health = _health(url) or {}
        canary = health.get("canary")
        staged = f" (canary {canary['version']}: {100 * canary['share']:.0f} % of requests)" if canary else ""
        say(f"[{time.monotonic() - t0:5.0f}s] {what}  champion {health.get('version')}{staged}  "
            f"accept rate by version: {rates or '-'}")

    final = "base"
    try:
        while time.monotonic() < deadline:
            ran = [c for c in recent_cycles(engine, 100) if c.state in ("done", "rejected")]
            progress(f"cycles {len(ran)}/{cycles}")
            if len(ran) >= cycles:
                break
            time.sleep(5)
        daemon.pause_cycles()
        final = _champion_served(daemon, url, deadline)
        while time.monotonic() < deadline and (served := fleet.stats.by_version.get(final, [0])[0]) < measure:
            progress(f"measuring {final}: {served}/{measure} requests")
            time.sleep(5)
    finally:
        fleet.stop.set()
        fleet_thread.join(timeout=60)  # the users' pending reactions are sent before it ends
        feedback_sender.close()
    _wait_stored(engine, fleet.stats.requests, fleet.stats.feedback, time.monotonic() + 60, say)
    return final


def _champion_served(daemon, url: str, deadline: float) -> str:
    """The registry's champion ("base" before any), once the server answers with it."""
    from deploy.registry import CHAMPION

    champion = daemon.deps.registry.alias(CHAMPION)
    want = str(champion.version) if champion is not None else "base"
    while served_version(url) != want and time.monotonic() < deadline:
        time.sleep(0.5)  # serving follows the model-update event
    return want


def _wait_stored(engine: Engine, requests_sent: int, feedback_sent: int, deadline: float, say) -> None:
    """Poll until ingest has stored what the fleet got answers to and what it sent."""
    while True:
        with engine.connect() as conn:
            stored = (conn.scalar(select(func.count()).select_from(interactions)),
                      conn.scalar(select(func.count()).select_from(feedback)))
        if stored[0] >= requests_sent and stored[1] >= feedback_sent:
            return
        if time.monotonic() > deadline:
            say(f"warning: the store holds {stored[0]} of {requests_sent} interactions and {stored[1]} of "
                f"{feedback_sent} feedback events the fleet produced; the report counts what is stored")
            return
        time.sleep(0.5)


def run_demo(state_dir: Path, cycles: int = 5, naive: bool = False, seed: int = 0, rate: float = 24.0,
             every: str = "45s", timeout_s: float = 900.0, measure: int = 200, say=print) -> DemoReport:
    """Run the demo in `<state_dir>/demo[-naive]` (wiped first); the report lands in its `report/`."""
    from deploy.registry import CHAMPION
    from deploy.tracking import MlflowTracker
    from pipeline import kafka_local
    from pipeline.core.store import db as store_db
    from pipeline.core.store.cycles import cycle_split
    from pipeline.cycle import default_deps
    from pipeline.daemon import Daemon
    from reward.spec import load_spec

    t0 = time.monotonic()
    run_dir = state_dir / ("demo-naive" if naive else "demo")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = demo_config(state_dir, run_dir, naive, every, seed, tag=uuid.uuid4().hex[:8])
    broker = kafka_local.up(config, progress=say)
    config.kafka.security = broker.access().security  # a local broker set up --secure: its users and CA
    kafka_local.ensure_topics(config.kafka_access, [config.kafka.interactions_topic, config.kafka.feedback_topic,
                                                 config.kafka.model_updates_topic], config.kafka.partitions)
    store_db.upgrade(config.db_url)
    engine = store_db.make_engine(config.db_url)
    base = build_base(config.train.base_model, seed, say)
    spec = load_spec(config.reward.spec)
    deps = default_deps(config, engine, spec)

    deps.registry.alias(CHAMPION)  # creates the MLflow store's tables before the server reads them
    # serving: the champion, following the registry (the base until the first promotion)
    server, url = start_server(config, base, run_dir)
    try:
        daemon = Daemon(config, deps, lease_ttl_s=30)
        daemon.start(ingest=True, metrics_port=None)
        try:
            champion = _run_fleet(config, engine, url, daemon, cycles, measure, rate, seed, every, timeout_s, t0,
                                  say)
        finally:
            daemon.shutdown()
    finally:
        stop_server(server)

    report = DemoReport(seconds=time.monotonic() - t0, champion=champion)
    report.versions = per_version(engine, spec.version)
    for c in reversed(recent_cycles(engine, 100)):
        run = get_run(engine, c.run_id) if c.run_id else None
        total = sum((c.timings or {}).values())
        summary = run.summary if run is not None and run.summary else {}
        loop_s = float(summary.get("loop_wall_s", summary.get("seconds", 0.0)))
        report.cycles.append({"cycle_id": c.cycle_id, "state": c.state, "candidate_version": c.candidate_version,
                              "reason": c.reason, "timings": c.timings, "seconds": round(total, 2),
                              "training_loop_s": round(loop_s, 2),
                              "overhead_frac": round(1 - loop_s / total, 3) if total else None,
                              "split": cycle_split(engine, c, run)})
    for d in all_decisions(engine):
        report.decisions.append({"candidate": d.candidate_version, "champion": d.champion_version,
                                 "stage": d.stage, "passed": d.passed, "reasons": d.reasons})
    report.files = write_report(report, run_dir / "report", naive)
    tracker = MlflowTracker(config.tracking_uri, config.mlflow.experiment, config.artifact_root, run_name="demo-report")
    tracker.log_params({"naive_reward": naive, "seed": seed, "cycles": cycles, "rate": rate, "every": every})
    for v in report.versions:
        if v["version"].isdigit():
            tracker.log_metrics({"accept_rate": v["accept_rate"]}, step=int(v["version"]))
    tracker.log_artifacts(run_dir / "report", "report")
    tracker.end("FINISHED")
    return report
