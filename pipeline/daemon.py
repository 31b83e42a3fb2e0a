"""`rtrl daemon`: ingest continuously, run a cycle on a schedule, one daemon at a time.

    ingest      a thread running the consumer-group member (every daemon ingests: partitions
                are shared by the group)
    lease       a job every ttl/3: renew the store's lease if we hold it, take it if it expired;
                only the holder runs cycles, so a second daemon waits and takes over within
                the lease's ttl when the first dies. Each cycle carries the lease's fencing
                token (its generation): a daemon that was paused past the ttl and lost the lease
                stops its cycle at the next state write or training step
    cycle       APScheduler job on `cycle.every` (interval or cron): max_instances=1, coalesced,
                with a misfire grace; runs pipeline/cycle.py's state machine if we hold the lease
    canary      with a staged rollout, a job every `rollout.check_every` that resumes a cycle
                waiting on its canary (so the online decision does not wait for the next cycle)
    metrics     Prometheus text on /metrics and a JSON /health, on 127.0.0.1 by default

SIGTERM/SIGINT: stop scheduling, drain and commit ingest, stop a running cycle before its next
stage or training step, release the lease (an interrupted cycle resumes from its state on the
next start, wherever it runs).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED, JobEvent
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ingest.consumer import IngestStats, run_ingest
from pipeline.core.config import DURATION, Config, duration_s
from pipeline.core.store.accept_tally import AcceptTally
from pipeline.core.store.cycles import CycleState, cycle_split, unfinished_cycle
from pipeline.core.store.leases import Fence, acquire, release
from pipeline.core.store.training import get_run
from pipeline.cycle import CycleDeps, run_cycle

log = logging.getLogger("rtrl.daemon")
logging.getLogger("apscheduler").setLevel(logging.WARNING)  # a line per job run drowns the daemon's own
LEASE = "cycle"


def trigger(every: str):
    """`30s` / `15m` / `4h` / `1d` -> an interval; five fields -> a cron expression."""
    every = every.strip()
    if DURATION.fullmatch(every):
        return IntervalTrigger(seconds=duration_s(every))
    return CronTrigger.from_crontab(every)


POLICY_METRICS_EVERY_S = 15.0  # how often the champion and per-alias metrics are read again


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ingested = Gauge("rtrl_ingest_events", "Events stored by this daemon's ingest", registry=r)
        self.ingest_rate = Gauge("rtrl_ingest_rate", "Events per second since ingest started", registry=r)
        self.lag = Gauge("rtrl_consumer_lag", "Records behind the high watermark", ["topic", "partition"], registry=r)
        self.dead_letters = Gauge("rtrl_dead_letters", "Dead letters written by this daemon's ingest", registry=r)
        self.ingest_errors = Counter(
            "rtrl_ingest_errors",
            "Times ingest stopped with an error (the broker or the store away) and was restarted",
            registry=r,
        )
        self.cycle_seconds = Histogram(
            "rtrl_cycle_duration_seconds",
            "Cycle wall time",
            buckets=(10, 30, 60, 300, 900, 1800, 3600, 4 * 3600, 12 * 3600),
            registry=r,
        )
        self.cycles = Counter("rtrl_cycles", "Cycles by outcome", ["outcome"], registry=r)
        self.sla_exceeded = Counter("rtrl_cycle_sla_exceeded", "Cycles longer than cycle.sla_s", registry=r)
        self.not_started = Counter(
            "rtrl_cycle_runs_not_started",
            "Scheduled cycles that did not start: the last one "
            "was still running (still_running), or the scheduler was late past the misfire "
            "grace (missed)",
            ["reason"],
            registry=r,
        )
        self.champion = Gauge("rtrl_champion_version", "Registry version of the champion (0: none)", registry=r)
        self.reward_mean = Gauge("rtrl_reward_mean", "Mean reward of the last training run's episodes", registry=r)
        self.gate = Counter("rtrl_gate_decisions", "Gate decisions", ["passed"], registry=r)
        self.lease_held = Gauge("rtrl_lease_held", "1 if this daemon holds the cycle lease", registry=r)
        self.cycle_parts = Gauge(
            "rtrl_cycle_part_seconds",
            "Seconds of the last cycle by part: a stage, or stage.part (train.loop is the training loop)",
            ["part"],
            registry=r,
        )
        self.outside_loop = Gauge(
            "rtrl_cycle_outside_loop_ratio",
            "Share of the last trained cycle spent outside the training loop",
            registry=r,
        )
        # the online check on a promotion: the gate's off-policy estimate can be optimistic
        # (README, "Known limitation"); alert when the champion's rate falls below previous's
        self.policy_served = Gauge(
            "rtrl_policy_served", "Requests served by the version under the alias", ["alias"], registry=r
        )
        self.policy_accept_rate = Gauge(
            "rtrl_policy_accept_rate",
            "Share of the requests served by the version under the alias that a user accepted",
            ["alias"],
            registry=r,
        )

    def on_ingest(self, stats: IngestStats) -> None:
        self.ingested.set(stats.events)
        self.ingest_rate.set(stats.rate)
        self.dead_letters.set(stats.dead_letters)
        for (topic, partition), lag in stats.lag.items():
            self.lag.labels(topic, str(partition)).set(lag)


class Daemon:
    def __init__(self, config: Config, deps: CycleDeps, lease_ttl_s: float = 60.0, owner: str | None = None) -> None:
        self.config, self.deps, self.ttl = config, deps, lease_ttl_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        deps.owner = self.owner
        self.metrics = Metrics()
        self.stop = threading.Event()
        self.holds_lease = False
        self.generation: int | None = None  # of the lease we hold: the fencing token of our cycles
        self.cycle_running = threading.Lock()
        self.scheduler = BackgroundScheduler(timezone="UTC")
        self.last_cycle: dict[str, Any] = {}
        self._ingest_thread: threading.Thread | None = None
        self.accepts = AcceptTally()  # the policy metrics' counts, read incrementally each cycle

    # --- jobs ----------------------------------------------------------------------------
    def heartbeat(self) -> None:
        if self.stop.is_set() and not self.holds_lease:  # shutting down: renew, never take it again
            return
        try:
            generation = acquire(self.deps.engine, LEASE, self.owner, self.ttl)
        except Exception as exc:  # noqa: BLE001 - the store may be away; we just do not hold the lease
            log.error("lease heartbeat failed", extra={"error": str(exc)})
            generation = None
        held = generation is not None
        if held != self.holds_lease or generation != self.generation:
            log.info(
                "cycle lease " + ("taken" if held else "lost"), extra={"owner": self.owner, "generation": generation}
            )
        self.holds_lease, self.generation = held, generation
        self.metrics.lease_held.set(1 if held else 0)

    def check_canary(self) -> None:
        """The rollout job: resume the cycle waiting on its canary, if there is one."""
        self.cycle(only_canary=True)

    def cycle(self, only_canary: bool = False) -> None:
        """The scheduled job: one cycle if we hold the lease. Never raises: a cycle that could not
        even record its failure (the store away) resumes from its last recorded state next time.
        A run the scheduler had already dispatched when shutdown began does nothing."""
        if self.stop.is_set():
            return
        self.heartbeat()
        if not self.holds_lease:
            if not only_canary:
                log.info("another daemon holds the cycle lease; not running a cycle")
            return
        # the canary job never waits behind a running cycle: that cycle is doing the work already
        if not self.cycle_running.acquire(blocking=not only_canary):
            return
        try:
            if self.stop.is_set() or (only_canary and not self._canary_waiting()):
                return
            t0 = time.perf_counter()
            self.deps.fence = Fence(LEASE, self.owner, self.generation)
            self.deps.stopping = self.stop
            try:
                row = run_cycle(self.deps)
            except Exception as exc:  # noqa: BLE001 - run_cycle records a failing stage; this is the store itself
                self.metrics.cycles.labels("unrecorded").inc()
                self.last_cycle = {"state": "unrecorded", "error": f"{type(exc).__name__}: {exc}"}
                log.error(
                    "cycle could not be recorded (is the store reachable?); it resumes from its last "
                    "recorded state at the next run",
                    extra=self.last_cycle,
                )
                return
            seconds = time.perf_counter() - t0
        finally:
            self.cycle_running.release()
        if row is None and self.stop.is_set():  # stopped by shutdown: the next start resumes it
            return
        if row is None:  # the lease was lost: the new holder resumes the cycle
            self.metrics.cycles.labels("lease_lost").inc()
            self.last_cycle = {"state": "lease_lost"}
            return
        if row.state == CycleState.CANARY:  # not finished: the canary is still being measured
            self.last_cycle = {"cycle_id": row.cycle_id, "state": row.state, "canary": row.candidate_version}
            self._online_metrics()
            return
        if row.finished_at is not None:  # a canary cycle ran across several calls: its whole life counts
            seconds = max(seconds, (row.finished_at - row.started_at).total_seconds())
        self.metrics.cycle_seconds.observe(seconds)
        self.metrics.cycles.labels(row.state).inc()
        if seconds > self.config.cycle.sla_s:
            self.metrics.sla_exceeded.inc()
        if row.state in (CycleState.DONE, CycleState.REJECTED):
            self.metrics.gate.labels(str(row.state == CycleState.DONE).lower()).inc()
        self.last_cycle = {
            "cycle_id": row.cycle_id,
            "state": row.state,
            "reason": row.reason,
            "seconds": round(seconds, 2),
        }
        try:
            self._cycle_metrics(row)
        except Exception as exc:  # noqa: BLE001 - the registry or the store may be away: metrics wait
            log.warning("cycle metrics not updated", extra={"error": f"{type(exc).__name__}: {exc}"})
        log.info("cycle finished", extra=self.last_cycle)

    def _canary_waiting(self) -> bool:
        try:
            row = unfinished_cycle(self.deps.engine)
        except Exception as exc:  # noqa: BLE001 - the store may be away: the next check retries
            log.warning("canary check skipped", extra={"error": f"{type(exc).__name__}: {exc}"})
            return False
        return row is not None and row.state == CycleState.CANARY

    def _online_metrics(self) -> None:
        """Requests served and accept rate of the champion, previous and canary versions."""
        try:
            registry = self.deps.registry
            champion = registry.alias("champion")
            self.metrics.champion.set(float(champion.version) if champion else 0.0)
            aliases = {
                "champion": champion,
                "previous": registry.alias("previous") if champion else None,
                "canary": registry.alias("canary"),
            }
            versions = {alias: v.version for alias, v in aliases.items() if v is not None}
            online = self.accepts.read(self.deps.engine, list(versions.values()))
        except Exception as exc:  # noqa: BLE001 - the registry or the store may be away: metrics wait
            log.warning("policy metrics not updated", extra={"error": f"{type(exc).__name__}: {exc}"})
            return
        self.metrics.policy_served.clear()
        self.metrics.policy_accept_rate.clear()
        for alias, version in versions.items():
            served, accepted = online.get(version, (0, 0))
            self.metrics.policy_served.labels(alias).set(served)
            if served:
                self.metrics.policy_accept_rate.labels(alias).set(accepted / served)

    def _cycle_metrics(self, row: Any) -> None:
        """The served versions, the run's reward mean and the cycle's split (registry and store reads)."""
        self._online_metrics()
        run = get_run(self.deps.engine, row.run_id) if row.run_id else None
        if run is not None and run.summary:
            self.metrics.reward_mean.set(run.summary.get("final", {}).get("reward_mean", 0.0))
        split = cycle_split(self.deps.engine, row, run)
        self.metrics.cycle_parts.clear()  # a part the last cycle did not have is not shown with an old value
        for part, part_s in split.items():
            self.metrics.cycle_parts.labels(part).set(part_s)
        total = sum(split.values())
        if split.get("train.loop") and total:
            outside = 1 - split["train.loop"] / total
            self.metrics.outside_loop.set(outside)
            self.last_cycle["outside_training_loop"] = round(outside, 3)

    def _not_started(self, event: JobEvent) -> None:
        """A scheduled cycle that did not run: counted, and said once per occurrence -- cycles
        that keep outlasting `cycle.every` mean the schedule is too tight for the data."""
        if event.job_id != "cycle":
            return
        reason = "still_running" if event.code == EVENT_JOB_MAX_INSTANCES else "missed"
        self.metrics.not_started.labels(reason).inc()
        log.warning(
            "scheduled cycle not started",
            extra={
                "reason": reason,
                "every": self.config.cycle.every,
                "hint": "the previous cycle outlasted cycle.every: lengthen the interval or cap train.max_episodes"
                if reason == "still_running"
                else "the daemon was busy or asleep past the misfire grace (300 s)",
            },
        )

    def _ingest(self) -> None:
        while not self.stop.is_set():
            try:
                run_ingest(self.config, self.deps.engine, self.stop, on_batch=self.metrics.on_ingest)
            except Exception as exc:  # noqa: BLE001 - the broker may be away: retry, never die
                self.metrics.ingest_errors.inc()
                log.error("ingest stopped with an error; restarting in 5 s", extra={"error": str(exc)})
                self.stop.wait(5)

    # --- lifecycle -----------------------------------------------------------------------
    def start(self, ingest: bool = True, metrics_port: int | None = None, host: str = "127.0.0.1") -> None:
        if metrics_port is not None:
            self._serve_metrics(host, metrics_port)
        if ingest:
            self._ingest_thread = threading.Thread(target=self._ingest, name="ingest", daemon=True)
            self._ingest_thread.start()
        self.heartbeat()
        self.scheduler.add_job(
            self.heartbeat, IntervalTrigger(seconds=max(self.ttl / 3, 1)), id="lease", max_instances=1, coalesce=True
        )
        self.scheduler.add_listener(self._not_started, EVENT_JOB_MAX_INSTANCES | EVENT_JOB_MISSED)
        self.scheduler.add_job(
            self.cycle,
            trigger(self.config.cycle.every),
            id="cycle",
            max_instances=1,
            coalesce=True,
            misfire_grace_time=300,
        )
        # the champion gauge and per-alias counts follow a promote or rollback made from the CLI
        # within this interval, not at the next cycle hours later
        self.scheduler.add_job(
            self._online_metrics, IntervalTrigger(seconds=POLICY_METRICS_EVERY_S), id="policy-metrics", max_instances=1
        )
        if self.config.rollout.share > 0:
            self.scheduler.add_job(
                self.check_canary, trigger(self.config.rollout.check_every), id="canary", max_instances=1, coalesce=True
            )
        self.scheduler.start()
        log.info("daemon started", extra={"owner": self.owner, "every": self.config.cycle.every})

    def pause_cycles(self) -> None:
        """Run no further cycle (ingest and the lease go on): `rtrl demo` measures the last champion."""
        self.scheduler.pause_job("cycle")
        if self.scheduler.get_job("canary") is not None:
            self.scheduler.pause_job("canary")

    def shutdown(self, drain_s: float = 60.0) -> None:
        """Stop scheduling; wait (up to `drain_s`) for ingest to store and commit what it has in
        flight, and for a running cycle to stop at its next stage or training step (its state
        written last is where the next start resumes); then release the lease, unless the cycle
        is still running (a stage that outlasted the wait)."""
        self.stop.set()
        self.scheduler.shutdown(wait=False)
        if self._ingest_thread is not None:
            self._ingest_thread.join(timeout=drain_s)
            if self._ingest_thread.is_alive():  # nothing is lost: the stored offsets say where to resume
                log.warning(
                    "ingest did not drain in time; the next start re-reads from the stored offsets",
                    extra={"drain_s": drain_s},
                )
        if self.cycle_running.acquire(timeout=drain_s):  # no cycle in progress: let another daemon go on
            self.release_lease()
            # a run dispatched before the scheduler stopped may be waiting on the lock: it finds
            # `stop` set and returns, rather than hold its thread (and the exit) forever
            self.cycle_running.release()
        else:
            log.warning("a cycle is still running; the lease expires instead", extra={"drain_s": drain_s})
        log.info("daemon stopped", extra={"owner": self.owner})

    def release_lease(self) -> None:
        """Give the cycle lease up now, so that another daemon goes on without waiting for its ttl."""
        self.holds_lease = False  # first: a heartbeat from now on does not take it again
        release(self.deps.engine, LEASE, self.owner)

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "owner": self.owner, "lease": self.holds_lease, "last_cycle": self.last_cycle}

    def _serve_metrics(self, host: str, port: int) -> None:
        daemon = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                if self.path == "/metrics":
                    body, ctype = generate_latest(daemon.metrics.registry), CONTENT_TYPE_LATEST
                elif self.path == "/health":
                    body, ctype = json.dumps(daemon.health()).encode(), "application/json"
                else:
                    self.send_error(404, "try /metrics or /health")
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
