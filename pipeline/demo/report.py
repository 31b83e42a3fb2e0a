"""The demo's report: the online accept rate per version and over time (per minute, with its
95 % interval, each promotion, rejection and canary marked), the cycles and where their
seconds went, and every decision -- as report.png, report.md and report.json. For the agent
task the rate is the episode success rate (final answers accepted per episode), with calls per
episode and the tool-call error rate beside it.

Every number is read from the store (served_and_accepted is the accept rate's one definition;
episode_summaries the episodes').
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import Engine

from pipeline.core.store.cycles import cycle_split, recent_cycles
from pipeline.core.store.deploys import all_decisions, moves
from pipeline.core.store.episodes import EpisodeSummary, episode_summaries
from pipeline.core.store.online import accepts_over_time, served_and_accepted, served_by
from pipeline.core.store.rewards import mean_rewards
from pipeline.core.store.training import get_run


@dataclass
class DemoReport:
    versions: list[dict[str, Any]] = field(default_factory=list)  # version, served, accept_rate, reward_mean
    timeline: list[dict[str, Any]] = field(default_factory=list)  # minute, served, accept_rate, accept_ci95
    markers: list[dict[str, Any]] = field(default_factory=list)  # minute, kind (promoted, rejected, canary), label
    decisions: list[dict[str, Any]] = field(default_factory=list)
    cycles: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    champion: str = "base"  # serving at the end
    files: list[Path] = field(default_factory=list)
    explore: list[str] = field(default_factory=list)  # commands that look around what the run did
    served_by: dict[str, dict[str, int]] = field(default_factory=dict)  # server -> version -> interactions
    canaries: list[dict[str, Any]] = field(default_factory=list)  # version, share (staged), answered, requests
    task: str = "reverse"  # "agent": `served` counts episodes and `accept_rate` is their success rate

    @property
    def unit(self) -> str:
        return "episodes" if self.task == "agent" else "requests"


def version_order(versions: Any) -> list[str]:
    """The base first, then the registry's versions in number order."""
    return sorted(versions, key=lambda v: (v != "base", int(v) if v.isdigit() else 0))


def per_version(engine: Engine, spec_version: str) -> list[dict[str, Any]]:
    """Online accept rate (the store's one definition: served_and_accepted) with its interval,
    and mean reward, per version."""
    counts, reward = served_and_accepted(engine), mean_rewards(engine, spec_version)
    order = version_order(counts)
    return [
        {
            "version": v,
            "served": counts[v][0],
            "accept_rate": counts[v][1] / counts[v][0],
            "accept_ci95": wilson(counts[v][1], counts[v][0]),
            "reward_mean": float(reward[v]) if v in reward else None,
        }
        for v in order
    ]


def per_version_episodes(episodes: list[EpisodeSummary], reward: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent task's per_version: episodes each version started, the share whose final answer
    was accepted (with its interval), calls per episode, the share of calls that wrote a broken
    tool call, and the mean reward of its calls (`reward`: mean_rewards)."""
    by: dict[str, list[int]] = {}
    for e in episodes:
        row = by.setdefault(e.version, [0, 0, 0, 0])
        row[0], row[1], row[2], row[3] = row[0] + 1, row[1] + e.succeeded, row[2] + e.calls, row[3] + e.tool_errors
    out = []
    for v in version_order(by):
        n, ok, calls, errors = by[v]
        out.append(
            {
                "version": v,
                "served": n,
                "accept_rate": ok / n,
                "accept_ci95": wilson(ok, n),
                "calls_per_episode": calls / n,
                "tool_error_rate": errors / max(calls, 1),
                "reward_mean": float(reward[v]) if v in reward else None,
            }
        )
    return out


def timeline(
    engine: Engine, bucket_s: float = 60.0, rows: list[tuple[datetime, str, bool]] | None = None
) -> tuple[list[dict[str, Any]], datetime | None]:
    """The accept rate over time -- of `rows` (served at, version, accepted; the agent task's:
    its episodes) or else every request's (accepts_over_time): one bucket per `bucket_s` of
    serving (minute 0 is the first served), each with its Wilson interval; and the time of
    minute 0 (None: nothing served)."""
    rows = accepts_over_time(engine) if rows is None else rows
    if not rows:
        return [], None
    t0 = rows[0][0]
    buckets: dict[int, list[int]] = {}
    for ts, _, accepted in rows:
        b = buckets.setdefault(int((ts - t0).total_seconds() // bucket_s), [0, 0])
        b[0], b[1] = b[0] + 1, b[1] + accepted
    return [
        {"minute": k * bucket_s / 60, "served": n, "accept_rate": a / n, "accept_ci95": wilson(a, n)}
        for k, (n, a) in sorted(buckets.items())
    ], t0


def markers(engine: Engine, model_name: str, t0: datetime | None) -> list[dict[str, Any]]:
    """What the loop decided, when (minutes since t0): each promotion, each canary staged, each
    rejection (by the gate or online)."""
    if t0 is None:
        return []
    out = []
    for m in moves(engine, model_name, limit=1000):
        if m.to_version is not None and m.alias in ("champion", "canary"):
            kind = "promoted" if m.alias == "champion" else "canary"
            out.append({"minute": (m.at - t0).total_seconds() / 60, "kind": kind, "label": f"v{m.to_version}"})
    for d in all_decisions(engine):
        if not d.passed:
            out.append(
                {
                    "minute": (d.decided_at - t0).total_seconds() / 60,
                    "kind": "rejected",
                    "label": f"v{d.candidate_version} ({d.stage})",
                }
            )
    return sorted(out, key=lambda m: m["minute"])


def canary_shares(engine: Engine, model_name: str) -> list[dict[str, Any]]:
    """Each canary stage: the share the registry staged, and the share of the requests served
    while it lasted that the canary answered -- what the router (rtrl serve, or rtrl gateway in
    front of it) actually did."""
    every = sorted(moves(engine, model_name, limit=1000), key=lambda m: (m.at, m.id))
    served = accepts_over_time(engine)
    out = []
    for k, stage in enumerate(every):
        if stage.alias != "canary" or stage.to_version is None:
            continue
        # until the next move of either alias: a promotion ends the stage before the canary is cleared
        end = every[k + 1].at if k + 1 < len(every) else None
        during = [version for at, version, _ in served if at >= stage.at and (end is None or at < end)]
        if during:
            out.append(
                {
                    "version": stage.to_version,
                    "share": stage.share,
                    "requests": len(during),
                    "answered": sum(v == stage.to_version for v in during) / len(during),
                }
            )
    return out


def collect(
    engine: Engine, spec_version: str, model_name: str, champion: str, seconds: float, task: str = "reverse"
) -> DemoReport:
    """The report's numbers, from the store."""
    if task == "agent":  # the episodes, read once for both
        episodes = episode_summaries(engine)
        versions = per_version_episodes(episodes, mean_rewards(engine, spec_version))
        rows = [(e.started, e.version, e.succeeded) for e in episodes]
    else:
        versions, rows = per_version(engine, spec_version), None
    report = DemoReport(
        seconds=seconds,
        champion=champion,
        versions=versions,
        served_by=served_by(engine),
        canaries=canary_shares(engine, model_name),
        task=task,
    )
    report.timeline, t0 = timeline(engine, rows=rows)
    report.markers = markers(engine, model_name, t0)
    for c in reversed(recent_cycles(engine, 100)):
        run = get_run(engine, c.run_id) if c.run_id else None
        total = sum((c.timings or {}).values())
        summary = run.summary if run is not None and run.summary else {}
        loop_s = float(summary.get("loop_wall_s", summary.get("seconds", 0.0)))
        report.cycles.append(
            {
                "cycle_id": c.cycle_id,
                "state": c.state,
                "candidate_version": c.candidate_version,
                "reason": c.reason,
                "timings": c.timings,
                "seconds": round(total, 2),
                "training_loop_s": round(loop_s, 2),
                "overhead_frac": round(1 - loop_s / total, 3) if total else None,
                "split": cycle_split(engine, c, run),
            }
        )
    report.decisions = [
        {
            "candidate": d.candidate_version,
            "champion": d.champion_version,
            "stage": d.stage,
            "passed": d.passed,
            "reasons": d.reasons,
        }
        for d in all_decisions(engine)
    ]
    return report


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a rate k/n (95 % by default): honest at small n and near 0 or 1,
    where the normal approximation is not (Wilson 1927)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * ((p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def headline(versions: list[dict[str, Any]], champion: str, task: str = "reverse") -> str:
    """One line: the base's accept rate (episode success rate), the last champion's, the gain
    in percentage points."""
    by = {v["version"]: v for v in versions}
    if "base" not in by or champion not in by or champion == "base":
        return f"No version was promoted over the base (serving at the end: {champion})."
    base, last = by["base"], by[champion]
    lo, hi = last["accept_ci95"]
    what, unit = ("Episode success rate", "episodes") if task == "agent" else ("Online accept rate", "requests")
    return (
        f"{what}: base {100 * base['accept_rate']:.1f} % of {base['served']} {unit} -> champion "
        f"v{champion} {100 * last['accept_rate']:.1f} % of {last['served']} (95 % CI {100 * lo:.1f}-"
        f"{100 * hi:.1f} %): {100 * (last['accept_rate'] - base['accept_rate']):+.1f} pp."
    )


def canary_line(canaries: list[dict[str, Any]]) -> str:
    """'Canaries, staged share -> answered: v1 50 % -> 49.2 % of 512 requests; ...'."""
    if not canaries:
        return "No canary was staged."
    return (
        "Canaries, staged share -> share of the requests they answered: "
        + "; ".join(
            f"v{c['version']} {100 * (c['share'] or 0):.0f} % -> {100 * c['answered']:.1f} % of {c['requests']:,}"
            for c in canaries
        )
        + "."
    )


def routing(by_server: dict[str, dict[str, int]]) -> str:
    """Who captured the traffic and routed it: "Captured and routed by rtrl-gateway: base 1,402,
    v1 (canary, then champion) 1,377 ..." -- per server, the interactions of each version."""
    parts = []
    for server, versions in sorted(by_server.items()):
        counts = ", ".join(
            f"{'v' if v.isdigit() else ''}{v} {n:,}"
            for v, n in sorted(versions.items(), key=lambda kv: (kv[0].isdigit(), int(kv[0]) if kv[0].isdigit() else 0))
        )
        parts.append(f"{server or 'unnamed'} ({sum(versions.values()):,}: {counts})")
    return "Requests captured and routed by " + "; ".join(parts) + "." if parts else "No requests were captured."


def write_report(report: DemoReport, out: Path, naive: bool) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (over_time, ax) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.6, 1]})
    _plot_over_time(over_time, report)
    names = [v["version"] for v in report.versions]
    ax.bar(names, [100 * v["accept_rate"] for v in report.versions], color="#4477aa", label="accept rate (%)")
    ax.set_xlabel("policy version (served)")
    ax.set_ylabel(f"{rate_name(report)} (%)")
    ax2 = ax.twinx()
    ax2.plot(
        names,
        [v["reward_mean"] if v["reward_mean"] is not None else float("nan") for v in report.versions],
        "o-",
        color="#cc6677",
        label="mean reward",
    )
    ax2.set_ylabel("mean reward")
    ax.set_title(f"per version: {rate_name(report)} (bars), mean reward (line)")
    fig.suptitle("rtrl demo" + (" (naive reward)" if naive else ""))
    fig.tight_layout()
    png = out / "report.png"
    fig.savefig(png, dpi=100)
    plt.close(fig)
    lines = [
        "# rtrl demo report" + (" (--naive-reward)" if naive else ""),
        "",
        f"{len(report.cycles)} cycles in {report.seconds:.0f} s.",
        "",
        headline(report.versions, report.champion, report.task),
        "",
        routing(report.served_by),
        "",
        canary_line(report.canaries),
        "",
    ]
    agent = report.task == "agent"
    lines += [
        f"| version | {report.unit} | {rate_name(report)} | 95 % CI | mean reward |"
        + (" calls per episode | tool-call errors |" if agent else ""),
        "|---|---:|---:|---:|---:|" + ("---:|---:|" if agent else ""),
    ]
    for v in report.versions:
        reward = "" if v["reward_mean"] is None else f"{v['reward_mean']:+.3f}"
        lo, hi = v["accept_ci95"]
        lines.append(
            f"| {v['version']} | {v['served']} | {100 * v['accept_rate']:.1f} % | "
            f"{100 * lo:.0f}-{100 * hi:.0f} % | {reward} |"
            + (f" {v['calls_per_episode']:.2f} | {100 * v['tool_error_rate']:.1f} % |" if agent else "")
        )
    lines += [
        "",
        "| cycle | state | candidate | seconds | training loop | outside the loop | reason |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for c in report.cycles:
        outside = "" if c["overhead_frac"] is None else f"{100 * c['overhead_frac']:.0f} %"
        lines.append(
            f"| {c['cycle_id']} | {c['state']} | {c['candidate_version'] or ''} | {c['seconds']} | "
            f"{c['training_loop_s']} | {outside} | {c['reason'] or ''} |"
        )
    gated = [c for c in report.cycles if c.get("split") and c["state"] in ("done", "rejected")]
    if gated:
        cycle_s = sum(c["seconds"] for c in gated)
        lines += [
            "",
            f"Where the {len(gated)} decided cycles' seconds went (all cycles together):",
            "",
            "| part | seconds | share |",
            "|---|---:|---:|",
        ]
        totals: dict[str, float] = {}
        for c in gated:
            for part, s in c["split"].items():
                totals[part] = totals.get(part, 0.0) + s
        for part, s in sorted(totals.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {part} | {s:.2f} | {100 * s / cycle_s:.1f} % |")
    lines += ["", "| candidate | champion | decided by | passed | failing checks |", "|---|---|---|---|---|"]
    lines += [
        f"| v{d['candidate']} | {('v' + d['champion']) if d['champion'] else 'base'} | {d['stage']} | "
        f"{d['passed']} | {'; '.join(d['reasons'])} |"
        for d in report.decisions
    ]
    md = out / "report.md"
    md.write_text("\n".join(lines) + "\n")
    data = out / "report.json"
    data.write_text(
        json.dumps(
            {
                "champion": report.champion,
                "versions": report.versions,
                "cycles": report.cycles,
                "decisions": report.decisions,
                "timeline": report.timeline,
                "markers": report.markers,
                "seconds": report.seconds,
                "task": report.task,
            },
            indent=2,
            default=str,
        )
    )
    return [png, md, data]


def rate_name(report: DemoReport) -> str:
    return "episode success rate" if report.task == "agent" else "online accept rate"


MARKER_STYLE = {"promoted": ("#228833", "-"), "canary": ("#ccbb44", ":"), "rejected": ("#ee6677", "--")}


def _plot_over_time(ax: Any, report: DemoReport) -> None:
    """Accept rate per minute with its 95 % band, and a vertical line at each decision."""
    minutes = [b["minute"] + 0.5 for b in report.timeline]  # each minute's point at its middle
    rates = [100 * b["accept_rate"] for b in report.timeline]
    # (each at least 0: an interval's bound at 0 % or 100 % can round past the rate by 1e-15,
    # which matplotlib refuses)
    ax.errorbar(
        minutes,
        rates,
        yerr=[
            [max(r - 100 * b["accept_ci95"][0], 0.0) for r, b in zip(rates, report.timeline)],
            [max(100 * b["accept_ci95"][1] - r, 0.0) for r, b in zip(rates, report.timeline)],
        ],
        fmt="o-",
        color="#4477aa",
        capsize=3,
        label=f"{rate_name(report)} (95 % interval)",
    )
    seen = set()
    for m in report.markers:
        colour, style = MARKER_STYLE[m["kind"]]
        ax.axvline(m["minute"], color=colour, linestyle=style, label=m["kind"] if m["kind"] not in seen else None)
        ax.annotate(m["label"], (m["minute"], 100), rotation=90, fontsize=7, va="top", ha="right", color=colour)
        seen.add(m["kind"])
    ax.set_ylim(0, 100)
    ax.set_xlabel("minutes since the first request")
    ax.set_ylabel(f"{rate_name(report)} (%), per minute")
    ax.set_title("the loop learning: accept rate over time")
    ax.legend(loc="lower right", fontsize=8)
