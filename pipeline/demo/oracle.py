"""The single-turn demo's users as an oracle: the exact expected reward of any policy, and draws
of what it would earn, without serving anything.

The simulated users (pipeline/demo/sim.py) react to an answer by its kind alone -- right (the
task reversed), an abstention, or wrong -- and the demo's reward spec scores those reactions. So
a policy that answers each task length with fixed probabilities of right / abstain / copy (the
wrong answer the demo's base writes) has an expected reward that can be computed exactly:

    E[r | policy] = sum over lengths L (uniform), tasks t of length L (uniform, no palindromes)
                    of  p_right(L) r(t, right) + p_abstain(L) r(t, abstain)
                        + p_copy(L) E[r(t, copy)]       E over the users' reaction to a wrong
                                                        answer: rejected 0.6 / edited 0.4, then
                                                        a follow-up 1/3 (sim.Fleet._react)

with every r(t, .) the demo spec's reward (reward/compute.py) of that reaction to that answer.
benchmarks/decisions.py measures the canary's test against it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np

from pipeline.core.textchecks import is_abstention
from pipeline.demo.sim import ABSTAIN_PATTERNS, ALPHABET, LENGTHS, P_DECLINE, P_DECLINE_HARD, P_REVERSE, Task
from reward.compute import Scorer
from reward.signals import Episode, Feedback
from reward.spec import load_spec

DEMO_SPEC = Path(__file__).with_name("demo_spec.toml")
T0 = datetime(2026, 1, 1, tzinfo=UTC)
# the users' reactions to a wrong answer and their probabilities (sim.Fleet._react)
WRONG = (
    ("rejected", False, 0.6 * 2 / 3),
    ("rejected", True, 0.6 / 3),
    ("edited", False, 0.4 * 2 / 3),
    ("edited", True, 0.4 / 3),
)


@dataclass(frozen=True)
class Policy:
    """Per task length: the probability of answering right and of abstaining; the rest copies."""

    right: dict[int, float]
    abstain: dict[int, float]

    @classmethod
    def base(cls) -> Policy:
        """The demo's base model as it is warmed up (sim.base_behaviour)."""
        return cls(
            {n: 0.0 if n == 6 else P_REVERSE for n in LENGTHS},
            {n: P_DECLINE_HARD if n == 6 else P_DECLINE for n in LENGTHS},
        )

    def shifted(self, right: float) -> Policy:
        """`right` more (or less) of every length's answers right, taken from (or given to)
        copying: a candidate `right` x 100 pp better or worse at every length."""
        return Policy(
            {n: min(max(p + right, 0.0), 1.0 - self.abstain[n]) for n, p in self.right.items()}, dict(self.abstain)
        )

    def abstaining(self, extra: float) -> Policy:
        """`extra` more of every length's answers abstentions, taken from copying (then from
        right answers): the hack a reward that pays for abstaining teaches (`rtrl demo --naive-reward`)."""
        right, abstain = {}, {}
        for n, p in self.right.items():
            a = min(self.abstain[n] + extra, 1.0)
            abstain[n], right[n] = a, min(p, 1.0 - a)
        return Policy(right, abstain)


class Oracle:
    """Every task's reward per reaction, under a spec (default: the demo's)."""

    def __init__(self, spec_path: Path = DEMO_SPEC) -> None:
        self.scorer = Scorer(load_spec(spec_path))
        self.tasks = [Task("".join(t)) for n in LENGTHS for t in itertools.product(ALPHABET, repeat=n) if t != t[::-1]]
        self.length = np.array([len(t.text) for t in self.tasks])
        # per task: r(right), r(abstain), then r(copy) for each reaction in WRONG
        self.table = np.array(
            [
                [self._reward(t, t.answer, [("accepted", None), ("persisted", None)]), self._reward(t, "sorry", [])]
                + [
                    self._reward(t, t.text, [(kind, t.answer)] + ([("followup", None)] if f else []))
                    for kind, f, _ in WRONG
                ]
                for t in self.tasks
            ]
        )
        # a task is drawn as sim.draw_task draws it: a length uniformly, then a string of it
        per_length = {n: int((self.length == n).sum()) for n in LENGTHS}
        self.p_task = np.array([1 / len(LENGTHS) / per_length[n] for n in self.length])
        self._values: dict[tuple[str, str], float] = {}

    def _reward(self, task: Task, output: str, reactions: list[tuple[str, str | None]]) -> float:
        fb = tuple(
            Feedback(f"f{i}", kind, 1.0, T0 + timedelta(seconds=i + 1), {"text": text} if text else None)
            for i, (kind, text) in enumerate(reactions)
        )
        return self.scorer(Episode("r", T0, "v", output, feedback=fb)).value

    def value(self, task: Task, output: str) -> float:
        """The exact expected reward of `output` as an answer to `task`: the users react to it by
        its kind (sim.Fleet._react) and the spec scores the reaction; only a wrong answer's
        reaction is random (WRONG)."""
        key = (task.text, output)
        if key not in self._values:
            if is_abstention(output, ABSTAIN_PATTERNS):
                v = self._reward(task, output, [])
            elif output.strip() == task.answer:
                v = self._reward(task, output, [("accepted", None), ("persisted", None)])
            else:
                v = sum(
                    p * self._reward(task, output, [(kind, task.answer)] + ([("followup", None)] if f else []))
                    for kind, f, p in WRONG
                )
            self._values[key] = v
        return self._values[key]

    def probabilities(self, policy: Policy) -> np.ndarray:
        """[tasks, 6]: each reaction's probability per task (right, abstain, then WRONG's)."""
        right = np.array([policy.right[n] for n in self.length])
        abstain = np.array([policy.abstain[n] for n in self.length])
        copy = 1.0 - right - abstain
        return np.column_stack([right, abstain] + [copy * p for _, _, p in WRONG])

    def expected(self, policy: Policy) -> float:
        """The exact expected reward of a request under `policy`."""
        return float(self.p_task @ (self.probabilities(policy) * self.table).sum(axis=1))

    def accept_rate(self, policy: Policy) -> float:
        return float(self.p_task @ self.probabilities(policy)[:, 0])

    def draw_tasks(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        return rng.choice(len(self.tasks), size=shape, p=self.p_task)

    def draw_rewards(self, rng: np.random.Generator, policy: Policy, tasks: np.ndarray) -> np.ndarray:
        """The reward each task in `tasks` earns when `policy` answers it and the users react."""
        cum = np.cumsum(self.probabilities(policy), axis=1)[tasks]  # [..., 6]
        reaction = (rng.random(tasks.shape)[..., None] > cum).sum(axis=-1)
        return self.table[tasks, np.minimum(reaction, self.table.shape[1] - 1)]
