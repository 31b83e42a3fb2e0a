"""The gate's estimators against the truth, on a finished demo's versions.

After a demo every registered version is a real adapter, and the demo's users are an oracle
(pipeline/demo/oracle.py): the exact expected reward of an answer to a task is known. So each
version's true expected reward is measured directly -- every version answers the same
`--truth-tasks` tasks a length (drawn as the users draw them) at the users' temperature, each
answer valued exactly -- and every estimator the gate has is checked against it, for each pair
(candidate, champion) of versions where the champion served traffic:

    importance      the gate's off-policy estimate from the champion's logged held-out episodes:
                    SNIS, plain IS, and the gate's choice (the lower bound of the two), with the
                    mean importance weight (coverage: 1 when the logged answers cover the candidate)
    direct          fresh answers to `--fresh-prompts` held-out prompts, `--fresh-samples` each,
                    scored by the calibrated outcome model the demo fitted (deploy/fresh.py)
    doubly_robust   the direct estimate plus the logged episodes' weighted residuals
    direct_oracle   the same fresh answers valued by the oracle: what the direct estimate would
                    be with a perfect outcome model (its error is the prompts' sampling alone)

    RTRL_STATE_DIR=/tmp/demo-state .venv/bin/rtrl demo            # any finished demo
    .venv/bin/python benchmarks/offpolicy_vs_online.py --state-dir /tmp/demo-state

Prints each pair's truth and estimates (point, and whether the gate's 95 % lower bound is above
0), then per estimator: mean absolute error and mean signed bias of the improvement against the
truth, ranking accuracy (the sign of the estimate agrees with the truth's, over pairs whose
true difference is at least `--min-gap`), and how many truly worse candidates -- and truly
better ones, by at least `--min-gap` -- the estimator's bound would have passed. `online` is
the difference of the two versions' own served means (noisy: they served different, few
requests), kept for reference.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
from pathlib import Path

import numpy as np
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.fresh import estimates  # noqa: E402
from deploy.offpolicy import compare_each  # noqa: E402
from deploy.stage import logged_episode  # noqa: E402
from pipeline.core.config import load_config  # noqa: E402
from pipeline.core.store import db as store_db  # noqa: E402
from pipeline.core.store.training import is_held_out  # noqa: E402
from pipeline.core.types import LoggedEpisode  # noqa: E402
from pipeline.demo.config import DEMO_SPEC  # noqa: E402
from pipeline.demo.oracle import Oracle  # noqa: E402
from pipeline.demo.sim import LENGTHS, Task, draw_task  # noqa: E402
from reward.spec import load_spec  # noqa: E402
from reward.stage import run_rewards  # noqa: E402
from train.inference import PolicySet  # noqa: E402
from train.outcome import OutcomeModel  # noqa: E402
from train.outcome_record import MANIFEST, latest  # noqa: E402
from train.outcome_stage import Scorer  # noqa: E402

ESTIMATORS = ("importance", "snis", "ipw", "direct", "doubly_robust", "direct_oracle", "online")
LABELS = {
    "importance": "IS (gate)",
    "snis": "SNIS",
    "ipw": "IPW",
    "direct": "direct",
    "doubly_robust": "DR",
    "direct_oracle": "direct*",
    "online": "online",
}  # direct*: the oracle as the outcome model


class OracleScorer:
    """An outcome model that is always right: the oracle's exact value of each answer."""

    usable, why = True, "the oracle"

    def __init__(self, oracle: Oracle) -> None:
        self.oracle = oracle

    def score(self, episodes: list[LoggedEpisode]) -> list[float | None]:
        return [self.oracle.value(Task(str(e.prompt)[:-1]), e.completion) for e in episodes]


def truth(
    policies: PolicySet, oracle: Oracle, names: dict[str, str | None], per_length: int, max_new_tokens: int, seed: int
) -> dict[str, float]:
    """Each version's expected reward: the mean over lengths (drawn uniformly, as the users draw
    them) of its answers' exact values on the same `per_length` tasks a length."""
    rng = random.Random(seed)
    tasks: dict[int, list[Task]] = {n: [] for n in LENGTHS}
    while min(len(v) for v in tasks.values()) < per_length:
        t = draw_task(rng)
        if len(tasks[len(t.text)]) < per_length:
            tasks[len(t.text)].append(t)
    out = {}
    for version, name in names.items():
        per = []
        for n in LENGTHS:
            gens = policies.generate(
                name,
                [t.prompt for t in tasks[n]],
                max_new_tokens=max_new_tokens,
                temperature=1.0,
                seed=seed,
                batch_size=64,
            )
            per.append(np.mean([oracle.value(t, g.text) for t, g in zip(tasks[n], gens)]))
        out[version] = float(np.mean(per))
        print(f"  truth v{version}: {out[version]:+.4f}", flush=True)
    return out


def held_out_served(conn, spec_version: str, version: str, holdout: float, limit: int) -> list[LoggedEpisode]:
    """The most recent `limit` held-out episodes `version` served, as the gate reads them."""
    rows = conn.execute(
        text(
            "SELECT i.request_id, i.body, r.value FROM interactions i JOIN rewards r ON r.request_id = i.request_id "
            "AND r.spec_version = :spec WHERE i.policy_version = :version ORDER BY i.id DESC"
        ),
        {"spec": spec_version, "version": version},
    )
    out = [logged_episode(*row) for row in rows if is_held_out(row[0], row[1], holdout)]
    return [e for e in out if e.behavior_logprobs][:limit]


def summarise(rows: list[dict[str, float]], min_gap: float) -> None:
    print(
        f"\n{'estimator':<15}{'pairs':>6}{'mean |err|':>11}{'mean bias':>10}{'ranked right':>13}"
        f"{'worse passed':>13}{'better passed':>14}"
    )
    for name in ESTIMATORS:
        have = [r for r in rows if name in r]
        if not have:
            continue
        err = np.array([r[name] - r["truth"] for r in have])
        ranked = [r for r in have if abs(r["truth"]) >= min_gap]
        right = sum(np.sign(r[name]) == np.sign(r["truth"]) for r in ranked)
        cells = []
        for side in (-1, 1):  # truly worse candidates, then truly better ones (by at least min_gap)
            pairs = [r for r in have if side * r["truth"] >= (0 if side < 0 else min_gap) and f"{name}_low" in r]
            cells.append(f"{sum(r[f'{name}_low'] > 0 for r in pairs)}/{len(pairs)}" if pairs else "-")
        print(
            f"{LABELS[name]:<15}{len(have):>6}{np.abs(err).mean():>11.4f}{err.mean():>+10.4f}"
            f"{f'{right}/{len(ranked)}':>13}{cells[0]:>13}{cells[1]:>14}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", type=Path, required=True, help="the state folder of a finished `rtrl demo`")
    ap.add_argument("--min-served", type=int, default=100, help="champions that served fewer are left out")
    ap.add_argument("--truth-tasks", type=int, default=1000, help="tasks a length each version answers for its truth")
    ap.add_argument("--fresh-prompts", type=int, help="held-out prompts answered afresh (default: the gate's)")
    ap.add_argument("--fresh-samples", type=int, help="answers per prompt (default: the gate's)")
    ap.add_argument("--min-gap", type=float, default=0.02, help="pairs closer than this are not ranked")
    ap.add_argument("--outcome-model", type=Path, help="a fit's folder (default: the newest under <state>/outcome)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    state = args.state_dir
    config = load_config(state / "demo" / "rtrl.toml")  # what the demo ran with
    gate = config.gate.model_copy(
        update={k: v for k, v in (("fresh_prompts", args.fresh_prompts), ("fresh_samples", args.fresh_samples)) if v}
    )
    holdout = config.train.holdout_percent
    engine = store_db.make_engine(config.db_url)
    spec = load_spec(DEMO_SPEC)
    run_rewards(engine, spec)  # the last reactions of the fleet, if the demo left any unrewarded
    with engine.connect() as conn:
        adapters = dict(
            conn.execute(
                text(
                    "SELECT g.candidate_version, t.adapter_path FROM gate_decisions g "
                    "JOIN training_runs t ON t.run_id = g.run_id"
                )
            ).all()
        )
        served = {
            v: (n, m)
            for v, n, m in conn.execute(
                text(
                    "SELECT policy_version, count(*), avg(value) FROM rewards WHERE spec_version = :spec "
                    "GROUP BY policy_version"
                ),
                {"spec": spec.version},
            )
        }
        data = {
            v: held_out_served(conn, spec.version, v, holdout, gate.eval_episodes)
            for v, (n, _) in served.items()
            if n >= args.min_served and (v in adapters or v == "base")
        }
    manifest = (
        json.loads((args.outcome_model / MANIFEST).read_text()) if args.outcome_model else latest(config.state_dir)
    )
    if manifest is None:  # (a short run): the other estimators are still measured
        print(f"no outcome model under {config.state_dir / 'outcome'}: direct and doubly robust left out")
    else:
        print(f"outcome model: {manifest['why']}")
    policies = PolicySet.load(config.train.base_model)
    names: dict[str, str | None] = {"base": None} if "base" in served else {}
    for v in sorted(adapters, key=int):
        policies.add(f"v{v}", adapters[v])
        names[v] = f"v{v}"
    model = Scorer(OutcomeModel.load(manifest["path"]), manifest) if manifest else None
    oracle = Oracle()
    true = truth(policies, oracle, names, args.truth_tasks, gate.max_new_tokens, args.seed)
    rows = []
    print(
        f"\n{'cand':>5} {'champ':>6} {'n':>4} {'truth':>7} "
        + " ".join(f"{LABELS[e]:>9}" for e in ESTIMATORS)
        + "   (* the 95 % lower bound is above 0)"
    )
    for target, behaviour in itertools.permutations(names, 2):
        if behaviour not in data:
            continue
        eps = data[behaviour]
        lp_c, lp_h, _ = policies.compare(names[target], names[behaviour], eps)
        keep = [i for i, (a, b) in enumerate(zip(lp_c, lp_h)) if a is not None and b is not None]
        logged = [eps[i] for i in keep]
        mu = [sum(e.behavior_logprobs) for e in logged]
        r = [e.reward for e in logged]
        c, h = [lp_c[i] for i in keep], [lp_h[i] for i in keep]
        row = {"truth": true[target] - true[behaviour]}
        if target in served:
            row["online"] = served[target][1] - served[behaviour][1]
        cand, _, *gains = compare_each(
            c, h, mu, r, cap=gate.sequence_ratio_cap, resamples=gate.bootstrap, confidence=gate.confidence
        )
        gate_gain = min(gains, key=lambda g: g.low)  # what compare() gives the gate
        for name, est in (("importance", gate_gain), ("snis", gains[0]), ("ipw", gains[1])):
            row.update({name: est.value, f"{name}_low": est.low})
        order = lambda e: e.request_id  # noqa: E731 - any fixed order: the held-out slice is already random
        for label, scorer in (("", model), ("_oracle", OracleScorer(oracle))):
            if scorer is None:
                continue
            found = estimates(
                policies, scorer, names[target], names[behaviour], eps, logged, c, h, gate, order, args.seed
            )
            for name, est in found.items():
                if est.improvement is not None and (label == "" or name == "direct"):
                    row.update({f"{name}{label}": est.improvement.value, f"{name}{label}_low": est.improvement.low})
        rows.append(row)
        cells = " ".join(
            f"{row[e]:>+8.3f}{'*' if row.get(f'{e}_low', -1) > 0 else ' '}" if e in row else f"{'-':>9}"
            for e in ESTIMATORS
        )
        print(
            f"{'v' + target:>5} {'v' + behaviour:>6} {len(logged):>4} {row['truth']:>+7.3f} {cells}  "
            f"coverage {cand.coverage:.2f}",
            flush=True,
        )
    summarise(rows, args.min_gap)


if __name__ == "__main__":
    main()
