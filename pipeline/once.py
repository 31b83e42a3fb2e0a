"""`rtrl daemon --once`: the loop for a scheduler's world (cron, a Kubernetes CronJob): one
cycle, then exit with a code that says what happened.

    1. ingest   store what the event topics hold now, until caught up (skipped with --no-ingest:
                ingest then runs elsewhere, e.g. `rtrl ingest` as a service)
    2. lease    take the store's cycle lease; a daemon (or another --once) holding it means no
                cycle here. Renewed every ttl/3 while the cycle runs, so that nobody takes it
                over mid-cycle, and released at the end, so that the next run goes on at once
    3. cycle    pipeline/cycle.py's state machine, once: the unfinished cycle resumed (a canary
                still waiting on traffic is looked at again) or a new one
    4. exit     EXIT_CODES: 0 whenever the loop did its job, whatever it decided

The settings are read afresh by every run: a change of the config file takes effect at the next
run (a long-running `rtrl daemon` reads them once, at start: restart it).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from ingest.consumer import run_ingest
from pipeline.daemon import Daemon

log = logging.getLogger("rtrl.daemon")

# what a run ended with -> its exit code. A rejected or skipped cycle is the loop working: a
# scheduler that retries failed jobs must not retry those (a CronJob's backoffLimit would).
EXIT_CODES: dict[str, int] = {
    "done": 0,  # the candidate was promoted
    "rejected": 0,  # the gate or the canary refused it
    "skipped": 0,  # too few new rewarded episodes to train
    "canary": 0,  # staged: waiting on live traffic; the next run looks at it again
    "failed": 1,  # a stage failed: its error is on the cycle (`rtrl status`); the next run starts afresh
    "unrecorded": 3,  # the store could not be written: the next run resumes from the last recorded state
    "lease_held": 4,  # another daemon holds the cycle lease: nothing ran here
    "lease_lost": 5,  # the lease was taken over mid-cycle: its new holder resumes the cycle
    "stopped": 6,  # SIGTERM/SIGINT: the cycle stopped before its next stage; the next run resumes it
}


@dataclass(frozen=True)
class OnceResult:
    outcome: str  # a key of EXIT_CODES
    cycle: dict[str, Any]  # what the daemon reports as its last cycle (cycle_id, state, reason, ...)
    ingested: int | None  # events stored by step 1 (None: skipped)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.outcome, 1)


def run_once(daemon: Daemon, ingest: bool = True) -> OnceResult:
    """Steps 1-4 above with `daemon`'s lease, cycle and metrics; `daemon.stop` (set by a signal)
    ends ingest and stops the cycle before its next stage."""
    ingested = None
    if ingest:
        stats = run_ingest(daemon.config, daemon.deps.engine, daemon.stop, until_caught_up=True)
        ingested = stats.events
    renewing = threading.Event()

    def renew() -> None:  # the daemon's heartbeat job, without its scheduler
        while not renewing.wait(max(daemon.ttl / 3, 1)):
            daemon.heartbeat()

    renewer = threading.Thread(target=renew, name="lease", daemon=True)
    renewer.start()
    try:
        daemon.cycle()
        if daemon.last_cycle:
            outcome = str(daemon.last_cycle["state"])
        else:  # no cycle ran, or shutdown stopped the one that did
            outcome = "stopped" if daemon.stop.is_set() else "lease_held"
    finally:
        renewing.set()
        renewer.join()
        if daemon.holds_lease:
            daemon.release_lease()
    log.info("one cycle run", extra={"outcome": outcome, **daemon.last_cycle})
    return OnceResult(outcome, dict(daemon.last_cycle), ingested)
