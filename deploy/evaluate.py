"""Evaluation of a candidate against the champion, on the same inputs.

    held-out episodes   the most recent rewarded episodes of the slice that never trains: each
                        policy's reward is estimated off-policy from the logged behaviour
                        log-probs (deploy/offpolicy.py), the improvement by a paired bootstrap
    KL                  KL(champion || candidate) per completion token on those episodes
    generation          greedy outputs on a hash-chosen sample of the held-out prompts (each
                        rendered with the tools it was served with) and on the regression suite (a
                        policy's answers are reused from earlier cycles): canaries (abstention,
                        length, repetition, greedy tool-call format errors,
                        pipeline/core/textchecks.py) and the suite's checkers
    tool calls          answers sampled at the serving temperature, the same draws for both
                        policies, to up to `gate.tool_prompts` held-out prompts that offered tools
                        of each kind -- a task's first call, and a call after a tool's result --
                        `gate.tool_samples` each: the share of each kind that write a malformed
                        tool call (tool_format_error_rate, tool_format_error_rate_after_result).
                        Apart, because a policy that learned to break its calls where it expects
                        to fail does so at one kind of step, which the other's mass would hide
    smoke               the candidate loads and generates; median latency per request
    improvement         every estimator of (candidate - champion) reward (deploy/estimators.py):
                        importance sampling on the held-out episodes; with a usable outcome
                        model, the direct and doubly robust estimates on fresh answers
                        (deploy/fresh.py); `gate.estimator` decides, `gate.fallback` without one

The models come through a Runner (train.inference.PolicySet implements it; the orchestration
layer passes it in): deploy never loads weights itself.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from dataclasses import dataclass, field
from typing import Any, Protocol

from deploy import fresh
from deploy.estimators import NEEDS_OUTCOME_MODEL, Estimated, choose
from deploy.gate import Comparison, Estimate, EvalReport
from deploy.offpolicy import compare
from deploy.suite import EMPTY, Suite
from pipeline.core.chat import parse_tool_calls
from pipeline.core.config import GateConfig
from pipeline.core.textchecks import is_abstention, malformed_tool_call, repeated_fraction
from pipeline.core.timing import Stopwatch
from pipeline.core.types import LoggedEpisode

NOT_MEASURED = Estimate(float("nan"), float("nan"), float("nan"))  # fails every comparison in the gate


class Runner(Protocol):
    names: set[str]  # the adapters loaded

    def add(self, name: str, adapter: Any) -> None: ...

    def prompt_tokens(self, prompt: Any, tools: list[dict] | None = None) -> int | None: ...

    def remove(self, name: str) -> None: ...

    def compare(
        self, p: str | None, q: str | None, episodes: list[Any], max_tokens: int | None = None
    ) -> tuple[list[float | None], list[float | None], float]: ...

    def generate(
        self,
        name: str | None,
        prompts: list[Any],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        batch_size: int = 1,
        reuse: bool = False,
        tools: list[dict] | None = None,
    ) -> list[Any]: ...


@dataclass
class Evaluation:
    candidate: EvalReport
    champion: EvalReport
    comparison: Comparison
    episodes: int  # held-out episodes in the off-policy estimate
    excluded: dict[str, int] = field(default_factory=dict)  # why the others are not
    outputs: dict[str, dict[str, str]] = field(default_factory=dict)  # policy -> suite item -> output

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "candidate": asdict(self.candidate),
            "champion": asdict(self.champion),
            "comparison": asdict(self.comparison),
            "episodes": self.episodes,
            "excluded": self.excluded,
        }


def broken_call(text: str, tools: list[dict] | None = None) -> bool:
    """`text` writes a malformed tool call, as serving flags one (pipeline/core/chat.py: it does not
    parse, names no tool offered, or its arguments break the tool's schema)."""
    if "<tool_call>" in text:  # the chat template's convention (pipeline/core/chat.py)
        return any(malformed_tool_call(c) for c in parse_tool_calls(text, tools).calls)
    if text.lstrip().startswith("{"):  # a bare JSON call (models without a tool template)
        try:
            return malformed_tool_call(json.loads(text))
        except ValueError:
            return True
    return False


def canaries(texts: list[str], abstention_patterns: tuple[str, ...]) -> dict[str, float]:
    n = max(len(texts), 1)
    return {
        "abstention_rate": sum(is_abstention(t, abstention_patterns) for t in texts) / n,
        "mean_length": sum(len(t) for t in texts) / n,
        "repetition_rate": sum(repeated_fraction(t, 3) > 0.5 for t in texts) / n,
        "greedy_tool_format_error_rate": sum(broken_call(t) for t in texts) / n,
    }


def _generate(
    runner: Runner,
    name: str | None,
    episodes: list[LoggedEpisode],
    max_new_tokens: int,
    temperature: float | None = 0.0,
    seed: int | None = None,
    reuse: bool = False,
    batch_size: int = 64,
) -> list[Any]:
    """One answer per episode's prompt, rendered with the tools it was served with; at
    `temperature` (None: each episode's own, as it was served)."""
    groups: dict[tuple[str, float], list[int]] = {}
    for i, e in enumerate(episodes):
        t = e.temperature if temperature is None else temperature
        groups.setdefault((json.dumps(e.tools, sort_keys=True), t), []).append(i)
    out: list[Any] = [None] * len(episodes)
    for (_, t), idx in groups.items():
        gens = runner.generate(
            name,
            [episodes[i].prompt for i in idx],
            max_new_tokens=max_new_tokens,
            temperature=t,
            seed=seed,
            batch_size=batch_size,
            reuse=reuse,
            tools=episodes[idx[0]].tools,
        )
        for i, g in zip(idx, gens):
            out[i] = g
    return out


def sample_order(e: LoggedEpisode) -> bytes:
    return hashlib.blake2b(e.request_id.encode(), digest_size=8).digest()


def generation_sample(episodes: list[LoggedEpisode], n: int) -> list[LoggedEpisode]:
    """`n` held-out episodes chosen by a hash of their request id: a uniform sample of the
    window, and one that mostly stays the same as the window slides from cycle to cycle, so a
    policy's greedy answers to it are mostly reused (Runner.generate(reuse=True))."""
    return sorted(episodes, key=sample_order)[:n]


def after_result(prompt: Any) -> bool:
    """The prompt's last message is a tool's result: the agent's call after a tool answered."""
    return (
        isinstance(prompt, list) and bool(prompt) and isinstance(prompt[-1], dict) and prompt[-1].get("role") == "tool"
    )


def tool_prompts(episodes: list[LoggedEpisode], per_kind: int) -> dict[str, list[LoggedEpisode]]:
    """Up to `per_kind` held-out episodes that offered tools, of each kind (metric name ->
    episodes), chosen by the hash generation_sample uses."""
    offered = [e for e in episodes if e.tools]
    return {
        "tool_format_error_rate": generation_sample([e for e in offered if not after_result(e.prompt)], per_kind),
        "tool_format_error_rate_after_result": generation_sample(
            [e for e in offered if after_result(e.prompt)], per_kind
        ),
    }


def _generate_report(
    runner: Runner,
    name: str | None,
    label: str,
    sample: list[LoggedEpisode],
    suite: Suite,
    patterns: tuple[str, ...],
    max_new_tokens: int,
    tools: dict[str, list[LoggedEpisode]],
    tool_samples: int,
    seed: int,
    load_error: str | None = None,
) -> tuple[EvalReport, dict[str, str]]:
    if load_error is not None:
        return EvalReport(label, NOT_MEASURED, 0.0, smoke_ok=False, smoke_error=load_error), {}
    suite_items = [LoggedEpisode(item.id, item.prompt, "") for item in suite.items]
    everything = sample + suite_items
    # the tool-format canary: answers sampled as they would be served (each prompt's own
    # temperature), `tool_samples` per prompt -- greedy answers stay well formed where sampled
    # ones break. One seed for both policies: the same random draws, so that their difference is
    # theirs and not the draws'
    offered = {metric: [e for e in episodes for _ in range(tool_samples)] for metric, episodes in tools.items()}
    try:
        # the smoke check: a few requests one at a time, as serving would (their latency), then
        # the rest in batches (greedy: the same outputs, much faster)
        smoke = [g for e in everything[:3] for g in _generate(runner, name, [e], max_new_tokens, batch_size=1)]
        gens = smoke + _generate(runner, name, everything[3:], max_new_tokens, reuse=True)
        sampled = {
            metric: _generate(runner, name, episodes, max_new_tokens, temperature=None, seed=seed)
            for metric, episodes in offered.items()
        }
    except Exception as exc:  # noqa: BLE001 - any failure to generate is the smoke check failing
        return EvalReport(label, NOT_MEASURED, 0.0, smoke_ok=False, smoke_error=f"{type(exc).__name__}: {exc}"), {}
    held, suite_out = gens[: len(sample)], gens[len(sample) :]
    outputs = {item.id: g.text for item, g in zip(suite.items, suite_out)}
    metrics = canaries([g.text for g in held], patterns)
    for metric, episodes in offered.items():  # (no prompt of the kind: no call can break)
        metrics[metric] = sum(broken_call(g.text, e.tools) for e, g in zip(episodes, sampled[metric])) / max(
            len(episodes), 1
        )
    metrics["smoke_latency_ms"] = statistics.median(g.latency_ms for g in smoke) if smoke else 0.0
    return EvalReport(label, Estimate(0.0, 0.0, 0.0), 0.0, metrics=metrics, regression=suite.run(outputs)), outputs


@dataclass(frozen=True)
class EvalJob:
    """One evaluation (evaluate): the candidate and the champion, two adapters loaded in `runner`,
    on the same held-out episodes, suite and prompts."""

    runner: Runner
    candidate: str  # the candidate's adapter name in `runner`
    champion: str | None  # the champion's (None: the base model)
    episodes: list[LoggedEpisode]  # the held-out slice (the gate's eval_episodes)
    cfg: GateConfig
    suite: Suite = EMPTY
    abstention_patterns: tuple[str, ...] = ()  # the reward spec's abstention guard, a canary here
    generate_prompts: int = 32
    max_new_tokens: int = 64
    seed: int = 0
    load_error: str | None = None  # the candidate's adapter did not load: the smoke check fails with it
    champion_label: str | None = None  # the champion's name in the report (default: its adapter's, or "base")
    watch: Stopwatch = field(default_factory=Stopwatch)  # gets the seconds generating, computing log-probs
    max_seq_len: int | None = None  # held-out episodes whose prompt alone is longer are left out (as training)
    outcome: fresh.OutcomeScorer | None = None  # None: none fitted yet; the direct and DR estimates say so


def evaluate(job: EvalJob) -> Evaluation:
    """Every measurement of the module's docstring, for `job`'s two policies."""
    runner, cfg, candidate, champion, seed = job.runner, job.cfg, job.candidate, job.champion, job.seed
    watch, max_seq_len, outcome = job.watch, job.max_seq_len, job.outcome
    excluded = {
        "no_behavior_logprobs": 0,
        "misaligned": 0,
        "unrenderable_prompts": 0,
        "empty_prompts": 0,
        "too_long": 0,
    }
    # a held-out prompt the chat template refuses, an empty one or one too long to run is the
    # data's fault, not the policies': left out and counted, so that it fails neither policy's
    # smoke check (nor exhausts memory) for as long as it sits in the window
    usable_prompts = []
    for e in job.episodes:
        n = runner.prompt_tokens(e.prompt, e.tools)
        if n is None:
            excluded["unrenderable_prompts"] += 1
        elif n == 0:  # nothing to generate from (a model cannot run on zero tokens)
            excluded["empty_prompts"] += 1
        elif max_seq_len is not None and n > max_seq_len:
            excluded["too_long"] += 1
        else:
            usable_prompts.append(e)
    episodes = usable_prompts
    sample, tools = generation_sample(episodes, job.generate_prompts), tool_prompts(episodes, cfg.tool_prompts)
    with watch("generate"):
        cand_report, cand_out = _generate_report(
            runner,
            candidate,
            "candidate",
            sample,
            job.suite,
            job.abstention_patterns,
            job.max_new_tokens,
            tools,
            cfg.tool_samples,
            seed,
            job.load_error,
        )
        champ_report, champ_out = _generate_report(
            runner,
            champion,
            job.champion_label or champion or "base",
            sample,
            job.suite,
            job.abstention_patterns,
            job.max_new_tokens,
            tools,
            cfg.tool_samples,
            seed,
        )
    usable = [e for e in episodes if e.behavior_logprobs]
    excluded["no_behavior_logprobs"] = len(episodes) - len(usable)
    kl = float("nan")
    if cand_report.smoke_ok:
        with watch("log_probs"):
            champ_lp, cand_lp, kl = runner.compare(champion, candidate, usable, max_tokens=max_seq_len)
        # "misaligned": no comparable log-prob (misaligned, out of vocabulary, too long: see compare)
        keep = [i for i, (a, b) in enumerate(zip(cand_lp, champ_lp)) if a is not None and b is not None]
        excluded["misaligned"] = len(usable) - len(keep)
        usable = [usable[i] for i in keep]
        cand_lp, champ_lp = [cand_lp[i] for i in keep], [champ_lp[i] for i in keep]
    if not cand_report.smoke_ok or not usable:
        return Evaluation(
            cand_report,
            champ_report,
            Comparison(NOT_MEASURED, float("nan")),
            0,
            excluded,
            {"candidate": cand_out, "champion": champ_out},
        )
    behavior = [sum(e.behavior_logprobs) for e in usable]
    with watch("estimate"):
        cand_est, champ_est, gain = compare(
            cand_lp,
            champ_lp,
            behavior,
            [e.reward for e in usable],
            cap=cfg.sequence_ratio_cap,
            resamples=cfg.bootstrap,
            confidence=cfg.confidence,
            seed=seed,
        )
    found = {
        "importance": Estimated(
            "importance",
            gain,
            len(usable),
            {
                "snis_candidate": cand_est.estimate.value,
                "snis_champion": champ_est.estimate.value,
                "ess_candidate": cand_est.ess,
                "ess_champion": champ_est.ess,
                "coverage_candidate": cand_est.coverage,
                "coverage_champion": champ_est.coverage,
            },
        )
    }
    missing = "is missing (none fitted yet)" if outcome is None else ("" if outcome.usable else outcome.why)
    if missing or not cfg.fresh_prompts:
        why = f"the outcome model {missing}" if missing else "gate.fresh_prompts is 0"
        found.update({name: Estimated(name, None, why_not=why) for name in NEEDS_OUTCOME_MODEL})
    else:
        with watch("fresh"):
            found.update(
                fresh.estimates(
                    runner, outcome, candidate, champion, episodes, usable, cand_lp, champ_lp, cfg, sample_order, seed
                )
            )
    choice = choose(found, cfg.estimator, cfg.fallback, missing)
    cand_report.reward, cand_report.ess = cand_est.estimate, cand_est.ess
    champ_report.reward, champ_report.ess = champ_est.estimate, champ_est.ess
    # the reward is a metric too: [gate.bounds.reward] can set value and change limits on it
    cand_report.metrics["reward"], champ_report.metrics["reward"] = cand_est.estimate.value, champ_est.estimate.value
    # how much of each policy's probability the logged completions cover: below 1, mass the
    # estimate cannot see (see deploy/offpolicy.py); [gate.bounds.coverage] can require a minimum
    cand_report.metrics["coverage"], champ_report.metrics["coverage"] = cand_est.coverage, champ_est.coverage
    comparison = Comparison(
        choice.improvement or NOT_MEASURED,
        kl,
        choice.estimator,
        choice.note,
        {name: e.to_dict() for name, e in found.items()},
        choice.refused,
    )
    return Evaluation(
        cand_report, champ_report, comparison, len(usable), excluded, {"candidate": cand_out, "champion": champ_out}
    )
