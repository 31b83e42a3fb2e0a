"""The canary's decisions against the truth: simulated canaries of known true differences to
their champion, the sequential test looked at continuously, over many runs.

The single-turn demo's users are an oracle (pipeline/demo/oracle.py): a policy that answers
each task length right / abstaining / copying with fixed probabilities has an exact expected
reward under the demo's spec (tests/unit/test_oracle.py checks it against the simulated users). The
champion is the demo's base; each candidate shifts its share of right answers by a known number
of points (an A/A copy shifts nothing) or abstains more (the hack `--naive-reward` teaches), so
the true difference of every pair is known exactly. Each run draws fresh tasks for both sides (share
0.5), the users' reactions, and a history of `--history` champion requests from before the
canary (the covariate: a task's mean reward there); the test is looked at every `--every`
episodes a side, as the daemon's check would, up to `--max-requests` a side.

    .venv/bin/python benchmarks/decisions.py                        # 2,000 runs a candidate, ~1 min
    .venv/bin/python benchmarks/decisions.py --runs 200 --covariate none

Prints, per candidate: its true difference, the share of runs promoted / withdrawn / undecided
at max-requests, the median episodes a side to the decision, and the fixed-size test's episodes
a side at the same error rates (one-sided alpha at -margin, power at the effect); then the
rates the targets are stated in. The test's parameters are RolloutConfig's defaults unless
given. Each run also goes through the gate's improvement check first (GateConfig's defaults: the
direct estimate on fresh answers with a perfect outcome model, tasks drawn afresh and the two
sides' answers drawn independently -- gate_passes; KL, the suite and the greedy canaries are
left out, and only refuse more): the share it passes, and the share the whole decision -- that
check, then the canary, on independent traffic -- promotes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy import sequential  # noqa: E402
from deploy.sequential import PROMOTE, TRUNCATED, WITHDRAW, Design  # noqa: E402
from pipeline.core.config import GateConfig, RolloutConfig  # noqa: E402
from pipeline.demo.oracle import WRONG, Oracle, Policy  # noqa: E402

# candidates: (name, the champion changed): right answers shifted by points at every length, or
# the abstention hack (a share of the answers that copied become "sorry")
CANDIDATES: list[tuple[str, Callable[[Policy], Policy]]] = [
    ("worse by 10 pp", lambda p: p.shifted(-0.10)),
    ("worse by 5 pp", lambda p: p.shifted(-0.05)),
    ("worse by 2 pp", lambda p: p.shifted(-0.02)),
    ("A/A copy", lambda p: p),
    ("better by 2 pp", lambda p: p.shifted(0.02)),
    ("better by 5 pp", lambda p: p.shifted(0.05)),
    ("better by 10 pp", lambda p: p.shifted(0.10)),
    ("abstains on 30 % more", lambda p: p.abstaining(0.30)),
]


def covariates(
    oracle: Oracle, rng: np.random.Generator, champion: Policy, tasks: np.ndarray, history: int
) -> np.ndarray:
    """Per run and episode: its task's mean reward among `history` champion requests served
    before the canary (the overall mean for a task never seen there) -- fixed before assignment."""
    runs = tasks.shape[0]
    if history == 0:
        return np.zeros(tasks.shape)
    past = oracle.draw_tasks(rng, (runs, history))
    earned = oracle.draw_rewards(rng, champion, past)
    n_tasks = len(oracle.tasks)
    flat = (np.arange(runs)[:, None] * n_tasks + past).ravel()
    sums = np.bincount(flat, weights=earned.ravel(), minlength=runs * n_tasks).reshape(runs, n_tasks)
    counts = np.bincount(flat, minlength=runs * n_tasks).reshape(runs, n_tasks)
    overall = earned.mean(axis=1, keepdims=True)
    means = np.where(counts > 0, sums / np.maximum(counts, 1), overall)
    return np.take_along_axis(means, tasks, axis=1)


def run_candidate(
    oracle: Oracle,
    champion: Policy,
    candidate: Policy,
    design: Design,
    runs: int,
    every: int,
    history: int,
    seed: int,
    chunk: int = 250,
) -> tuple[np.ndarray, np.ndarray]:
    verdicts, ats = [], []
    rng = np.random.default_rng(seed)
    for start in range(0, runs, chunk):
        r = min(chunk, runs - start)
        sides = []
        for policy in (champion, candidate):
            tasks = oracle.draw_tasks(rng, (r, design.max_n))
            sides.append((oracle.draw_rewards(rng, policy, tasks), covariates(oracle, rng, champion, tasks, history)))
        verdict, at = sequential.monitor(sides[0], sides[1], design, every=every)
        verdicts.append(verdict)
        ats.append(at)
    return np.concatenate(verdicts), np.concatenate(ats)


def gate_passes(
    oracle: Oracle, champion: Policy, candidate: Policy, gate: GateConfig, runs: int, seed: int
) -> np.ndarray:
    """[runs] whether the gate's direct estimate passes the candidate: `gate.fresh_prompts`
    requests' tasks, `gate.fresh_samples` answers a side each, every answer scored by the oracle's
    exact value of its kind (a perfect outcome model; one off by a shift or a positive scale
    decides the same at min_improvement 0, since the check reads the lower bound's sign), the improvement's lower
    bound above `gate.min_improvement`. The bound is the normal one over prompts (the gate's
    percentile bootstrap of a mean of 256 paired differences agrees with it to the third digit)."""
    rng = np.random.default_rng(seed)
    values = np.column_stack(
        [oracle.table[:, 0], oracle.table[:, 1], oracle.table[:, 2:] @ np.array([p for _, _, p in WRONG])]
    )  # [tasks, 3]
    tasks = oracle.draw_tasks(rng, (runs, gate.fresh_prompts))  # [R, P]
    means = []
    for policy in (candidate, champion):
        probs = oracle.probabilities(policy)
        cum = np.cumsum(np.column_stack([probs[:, 0], probs[:, 1], probs[:, 2:].sum(axis=1)]), axis=1)[tasks]
        kinds = (rng.random((*tasks.shape, gate.fresh_samples))[..., None] > cum[..., None, :]).sum(axis=-1)
        means.append(values[tasks[..., None], np.minimum(kinds, 2)].mean(axis=-1))  # [R, P]
    diff = means[0] - means[1]
    z = statistics.NormalDist().inv_cdf(0.5 + gate.confidence / 2)
    low = diff.mean(axis=1) - z * diff.std(axis=1, ddof=1) / np.sqrt(diff.shape[1])
    return low > gate.min_improvement


def sd_of(oracle: Oracle, policy: Policy) -> float:
    mean = oracle.expected(policy)
    second = float(oracle.p_task @ (oracle.probabilities(policy) * oracle.table**2).sum(axis=1))
    return (second - mean**2) ** 0.5


def main() -> None:
    defaults = RolloutConfig()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000, help="simulated canaries per candidate")
    parser.add_argument("--every", type=int, default=10, help="episodes a side between looks")
    parser.add_argument("--max-requests", type=int, default=1000, help="episodes a side at which a run stops")
    parser.add_argument("--min-requests", type=int, default=defaults.min_requests)
    parser.add_argument("--margin", type=float, default=defaults.margin)
    parser.add_argument("--effect", type=float, default=defaults.effect)
    parser.add_argument("--confidence", type=float, default=defaults.confidence)
    parser.add_argument("--power", type=float, default=defaults.power)
    parser.add_argument("--covariate", choices=("prompt", "none"), default="prompt")
    parser.add_argument(
        "--history",
        type=int,
        default=defaults.covariate_history,
        help="champion requests before the canary the covariate is computed from",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    design = Design(args.margin, args.effect, 1 - args.confidence, 1 - args.power, args.min_requests, args.max_requests)
    history = args.history if args.covariate == "prompt" else 0
    oracle = Oracle()
    champion = Policy.base()
    base = oracle.expected(champion)
    print(
        f"champion: the demo's base, accept rate {100 * oracle.accept_rate(champion):.1f} %, expected reward "
        f"{base:+.4f} (sd {sd_of(oracle, champion):.3f}); margin {design.margin}, effect {design.effect}, "
        f"alpha {design.alpha:.3g}, beta {design.beta:.3g}, looks every {args.every} episodes a side from "
        f"{design.min_n} to {design.max_n}; covariate {args.covariate}"
        + (f" ({history} requests of history)" if history else "")
        + f"; {args.runs} runs a candidate\n"
    )
    gate = GateConfig()
    print(
        "| candidate | true difference | promoted | withdrawn | undecided | median episodes a side | "
        "fixed-size test's | ratio | gate passes | gate, then canary, promote |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    started = time.perf_counter()
    results, whole = {}, {}
    ratios = []
    for i, (name, change) in enumerate(CANDIDATES):
        candidate = change(champion)
        truth = oracle.expected(candidate) - base
        verdict, at = run_candidate(
            oracle, champion, candidate, design, args.runs, args.every, history, args.seed * 1000 + i
        )
        fixed = sequential.fixed_horizon_n(sd_of(oracle, champion), sd_of(oracle, candidate), design)
        passed = gate_passes(oracle, champion, candidate, gate, args.runs, args.seed * 1000 + 500 + i)
        whole[name] = (truth, np.mean(passed & (verdict == PROMOTE)))
        decided = verdict != TRUNCATED
        median = float(np.median(np.where(decided, at, design.max_n)))
        results[name] = (truth, np.mean(verdict == PROMOTE), median, fixed)
        ratios.append(np.where(decided, at, design.max_n) / fixed)
        print(
            f"| {name} | {truth:+.4f} | {100 * np.mean(verdict == PROMOTE):.1f} % | "
            f"{100 * np.mean(verdict == WITHDRAW):.1f} % | {100 * np.mean(~decided):.1f} % | {median:.0f} | "
            f"{fixed} | {median / fixed:.2f} | {100 * np.mean(passed):.1f} % | {100 * whole[name][1]:.1f} % |"
        )
    print(f"\n({time.perf_counter() - started:.0f} s)")
    worse = [v for v in results.values() if v[0] < -design.margin]
    print(
        "promoted, of candidates worse than the margin: "
        + ", ".join(f"{100 * v[1]:.1f} % (true {v[0]:+.3f})" for v in worse)
    )
    print(
        "promoted, of the +5 pp candidate within {} a side: {:.1f} %".format(
            design.max_n, 100 * results["better by 5 pp"][1]
        )
    )
    print(
        f"median episodes to a decision / the fixed-size test's, over every run of every candidate: "
        f"{float(np.median(np.concatenate(ratios))):.2f}"
    )
    print(
        "the whole decision (gate, then canary) promotes: A/A copies {:.1f} %, truly worse candidates ".format(
            100 * whole["A/A copy"][1]
        )
        + ", ".join(f"{100 * p:.1f} % (true {t:+.3f})" for t, p in whole.values() if t < 0)
    )


if __name__ == "__main__":
    main()
