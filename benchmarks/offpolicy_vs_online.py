"""The gate's off-policy estimates against what the versions earned online, on a demo's store.

The gate compares a candidate with the champion by importance sampling over the champion's
logged episodes (deploy/offpolicy.py). After a demo, every promoted version has served real
(simulated) traffic, so the estimate can be checked against the truth: for each pair of
versions (target, behaviour), estimate the target's mean reward from the behaviour's served
episodes and compare it with the target's own online mean reward.

    RTRL_STATE_DIR=/tmp/demo-state .venv/bin/rtrl demo            # any finished demo
    .venv/bin/python benchmarks/offpolicy_vs_online.py --state-dir /tmp/demo-state

Prints, per pair, the true difference (online means), the self-normalised (SNIS) and plain
(IPW) estimates of it, the gate's interval for the improvement, and the mean importance weight
(how much of the target's probability the logged responses cover: 1 when fully covered).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deploy.evaluate import LoggedEpisode  # noqa: E402
from deploy.offpolicy import clipped_weights, compare, ipw, snis  # noqa: E402
from deploy.stage import logged_episode  # noqa: E402
from pipeline.core.store import db as store_db  # noqa: E402
from pipeline.demo.config import DEMO_SPEC  # noqa: E402
from reward.spec import load_spec  # noqa: E402
from reward.stage import run_rewards  # noqa: E402
from train.inference import PolicySet  # noqa: E402

CAP = 20.0  # the gate's default sequence_ratio_cap


def served_episodes(conn, spec_version: str, version: str) -> list[LoggedEpisode]:
    rows = conn.execute(text(
        "SELECT i.request_id, i.body, r.value FROM interactions i JOIN rewards r ON r.request_id = i.request_id "
        "AND r.spec_version = :spec WHERE i.policy_version = :version ORDER BY i.id"),
        {"spec": spec_version, "version": version})
    return [ep for ep in (logged_episode(*row) for row in rows) if ep.behavior_logprobs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", type=Path, required=True, help="the state folder of a finished `rtrl demo`")
    ap.add_argument("--min-served", type=int, default=100, help="versions that served fewer are left out")
    ap.add_argument("--base", type=Path, help="the demo's base model (default: <state-dir>/demo-base)")
    args = ap.parse_args()
    state = args.state_dir
    engine = store_db.make_engine(f"sqlite:///{state / 'demo' / 'rtrl.db'}")
    spec = load_spec(DEMO_SPEC)
    run_rewards(engine, spec)  # the last reactions of the fleet, if the demo left any unrewarded
    with engine.connect() as conn:
        adapters = dict(conn.execute(text(
            "SELECT g.candidate_version, t.adapter_path FROM gate_decisions g "
            "JOIN training_runs t ON t.run_id = g.run_id")).all())
        online = {v: (n, m) for v, n, m in conn.execute(text(
            "SELECT policy_version, count(*), avg(value) FROM rewards WHERE spec_version = :spec "
            "GROUP BY policy_version"), {"spec": spec.version}) if v in adapters and n >= args.min_served}
        data = {v: served_episodes(conn, spec.version, v) for v in online}
    policies = PolicySet.load(args.base or state / "demo-base")
    for v in online:
        policies.add(f"v{v}", adapters[v])
    print(f"{'target':>6} {'on data of':>10} {'n':>5} {'truth':>7} {'SNIS':>7} {'IPW':>7} "
          f"{'gate interval':>17} {'mean w':>7}")
    for target, behaviour in itertools.permutations(sorted(online, key=int), 2):
        eps = data[behaviour]
        lp_target, lp_behaviour, _ = policies.compare(f"v{target}", f"v{behaviour}", eps)
        keep = [i for i, (a, b) in enumerate(zip(lp_target, lp_behaviour)) if a is not None and b is not None]
        mu = np.array([sum(eps[i].behavior_logprobs) for i in keep])  # [N] what was served
        r = np.array([eps[i].reward for i in keep])  # [N]
        lt = np.array([lp_target[i] for i in keep])
        w = clipped_weights(lt, mu, CAP)
        est, _, gain = compare(lt, [lp_behaviour[i] for i in keep], mu, r, cap=CAP)
        truth = online[target][1] - online[behaviour][1]
        print(f"{'v' + target:>6} {'v' + behaviour:>10} {len(keep):>5} {truth:>+7.3f} "
              f"{snis(w, r) - r.mean():>+7.3f} {ipw(w, r) - r.mean():>+7.3f} "
              f"  [{gain.low:+.3f}, {gain.high:+.3f}] {est.coverage:>7.2f}")


if __name__ == "__main__":
    main()
