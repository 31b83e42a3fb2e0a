"""The demo's oracle against the simulator it stands for: the mean reward of requests the real
fleet's users react to, scored by the demo's spec, matches the oracle's exact expectation (the
truth benchmarks/decisions.py measures the canary against), for the base and for changed
policies; and the oracle's draws have that mean."""

from __future__ import annotations

import random
import time
from datetime import timedelta

import numpy as np
import pytest

from pipeline.demo.oracle import T0, WRONG, Oracle, Policy
from pipeline.demo.sim import Fleet, draw_task
from reward.signals import Episode, Feedback


@pytest.fixture(scope="module")
def oracle() -> Oracle:
    return Oracle()


def simulated_mean(oracle: Oracle, policy: Policy, n: int, seed: int) -> tuple[float, float]:
    """(mean, standard error) of the demo spec's reward over `n` requests the simulator's users
    reacted to (sim.Fleet._react, its own delays), each answer drawn from `policy`."""
    rng = random.Random(seed)
    fleet = Fleet("http://unused", lambda event: None, seed=seed)
    values = []
    for i in range(n):
        task = draw_task(rng)
        u, length = rng.random(), len(task.text)
        p_right, p_abstain = policy.right[length], policy.abstain[length]
        output = task.answer if u < p_right else ("sorry" if u < p_right + p_abstain else task.text)
        fleet._due.clear()
        start = time.monotonic()
        fleet._react(f"r{i}", task, output)
        feedback = tuple(
            Feedback(e["event_id"], e["kind"], float(e["value"]), T0 + timedelta(seconds=at - start), e.get("payload"))
            for at, _, e in sorted(fleet._due)
        )
        values.append(oracle.scorer(Episode(f"r{i}", T0, "v", output, feedback=feedback)).value)
    a = np.array(values)
    return float(a.mean()), float(a.std(ddof=1) / np.sqrt(n))


@pytest.mark.parametrize(
    "change",
    [lambda p: p, lambda p: p.shifted(0.2), lambda p: p.abstaining(0.3)],
    ids=["base", "right +20 pp", "abstains 30 % more"],
)
def test_the_oracle_expects_what_the_simulated_users_pay(oracle, change):
    policy = change(Policy.base())
    mean, se = simulated_mean(oracle, policy, 6000, seed=3)
    assert abs(oracle.expected(policy) - mean) < 4 * se, (oracle.expected(policy), mean, se)
    draws = oracle.draw_rewards(np.random.default_rng(0), policy, oracle.draw_tasks(np.random.default_rng(1), (20000,)))
    assert abs(draws.mean() - oracle.expected(policy)) < 4 * draws.std() / np.sqrt(len(draws))


def test_a_shifted_policy_differs_from_the_base_by_what_it_changed(oracle):
    base = Policy.base()
    assert oracle.accept_rate(base.shifted(0.05)) - oracle.accept_rate(base) == pytest.approx(
        0.05
    )  # every length, six letters too
    assert oracle.expected(base.shifted(0.05)) > oracle.expected(base) > oracle.expected(base.shifted(-0.05))
    assert oracle.expected(base.abstaining(0.3)) < oracle.expected(base)  # the users pay nothing for "sorry"


def test_an_answers_value_is_what_the_simulated_users_pay_for_it(oracle):
    """Oracle.value (the truth benchmarks/offpolicy_vs_online.py values real versions' answers
    by): the table's entries for right, abstaining and copied answers, and for any other wrong
    answer the mean reward of the simulator's users' reactions to it."""
    i = 7
    task = oracle.tasks[i]
    assert oracle.value(task, task.answer) == pytest.approx(oracle.table[i, 0])
    assert oracle.value(task, "sorry, no") == pytest.approx(oracle.table[i, 1])
    assert oracle.value(task, task.text) == pytest.approx(oracle.table[i, 2:] @ [p for _, _, p in WRONG])
    fleet, values = Fleet("http://unused", lambda event: None, seed=5), []
    for k in range(3000):
        fleet._due.clear()
        start = time.monotonic()
        fleet._react(f"r{k}", task, "eeeeee")
        feedback = tuple(
            Feedback(e["event_id"], e["kind"], float(e["value"]), T0 + timedelta(seconds=at - start), e.get("payload"))
            for at, _, e in sorted(fleet._due)
        )
        values.append(oracle.scorer(Episode(f"r{k}", T0, "v", "eeeeee", feedback=feedback)).value)
    assert abs(oracle.value(task, "eeeeee") - np.mean(values)) < 4 * np.std(values) / np.sqrt(len(values))
