"""Fresh answers for the gate: each policy answers held-out prompts now, the outcome model scores
the answers, and the direct and doubly robust estimates are made of them (deploy/estimators.py).

    prompts   the prompts (each with the tools it offered) of `gate.fresh_prompts` held-out
              requests, chosen by the hash that picks the canaries' sample (evaluate.py): a
              uniform sample of the window's requests that mostly stays the same from cycle to
              cycle. Requests, not distinct prompts: a prompt asked often weighs as often as
              users ask it (one per distinct prompt would over-weigh the rare ones -- the long,
              hard tasks -- and bias both policies' values toward them)
    answers   `gate.fresh_samples` per prompt and policy, at the temperature and top-p each was
              served with, one seed for both policies: the same random draws, so that their
              difference is theirs and not the draws'
    scores    the calibrated outcome model (train/outcome.py, passed in by the orchestration
              layer: deploy loads no model); its prediction of each logged answer is the
              doubly robust estimate's control variate
"""

from __future__ import annotations

import json
from typing import Any, Protocol

import numpy as np

from deploy.estimators import Estimated, direct, doubly_robust, prompt_means
from pipeline.core.config import GateConfig
from pipeline.core.types import LoggedEpisode


class OutcomeScorer(Protocol):
    usable: bool  # good enough for the gate to use (train/outcome.py judge())
    why: str  # its figures, or why it is not usable

    def score(self, episodes: list[LoggedEpisode]) -> list[float | None]: ...


def prompt_id(e: LoggedEpisode) -> str:
    return json.dumps([e.prompt, e.tools], sort_keys=True)


def fresh_prompts(episodes: list[LoggedEpisode], n: int, order: Any) -> list[LoggedEpisode]:
    """The first `n` episodes in `order` (a key on episodes): their prompts are answered afresh,
    a prompt as many times as it was asked among them."""
    return sorted(episodes, key=order)[:n]


def answer(
    runner: Any, name: str | None, prompts: list[LoggedEpisode], samples: int, max_new_tokens: int, seed: int
) -> list[list[LoggedEpisode]]:
    """[P][K] each prompt's K fresh answers by policy `name`, as episodes to score."""
    groups: dict[tuple[str, float, float], list[int]] = {}
    for i, e in enumerate(prompts):
        groups.setdefault((json.dumps(e.tools, sort_keys=True), e.temperature, e.top_p), []).append(i)
    out: list[list[LoggedEpisode]] = [[] for _ in prompts]
    for (_, temperature, top_p), idx in groups.items():
        asked = [i for i in idx for _ in range(samples)]
        gens = runner.generate(
            name,
            [prompts[i].prompt for i in asked],
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            seed=seed,
            batch_size=64,
            tools=prompts[idx[0]].tools,
        )
        for i, g in zip(asked, gens):
            e = prompts[i]
            out[i].append(
                LoggedEpisode(
                    f"{e.request_id}/fresh",
                    e.prompt,
                    g.text,
                    list(g.token_ids) or None,
                    temperature=e.temperature,
                    tools=e.tools,
                )
            )
    return out


def _scored(outcome: OutcomeScorer, answers: list[list[LoggedEpisode]]) -> np.ndarray:
    flat = [a for row in answers for a in row]
    scores = outcome.score(flat)
    rows, k = [], 0
    for row in answers:
        rows.append(scores[k : k + len(row)])
        k += len(row)
    return prompt_means(rows)  # [P]


def estimates(
    runner: Any,
    outcome: OutcomeScorer,
    candidate: str,
    champion: str | None,
    episodes: list[LoggedEpisode],
    logged: list[LoggedEpisode],
    candidate_logp: list[float],
    champion_logp: list[float],
    cfg: GateConfig,
    order: Any,
    seed: int = 0,
) -> dict[str, Estimated]:
    """The direct and doubly robust estimates. `episodes`: the held-out episodes whose prompts
    may be answered; `logged`: those with both policies' log-probs of the logged answer
    (aligned with `candidate_logp`, `champion_logp`)."""
    prompts = fresh_prompts(episodes, cfg.fresh_prompts, order)
    cand = _scored(outcome, answer(runner, candidate, prompts, cfg.fresh_samples, cfg.max_new_tokens, seed))
    champ = _scored(outcome, answer(runner, champion, prompts, cfg.fresh_samples, cfg.max_new_tokens, seed))
    found = {"direct": direct(cand, champ, cfg.bootstrap, cfg.confidence, seed)}
    found["direct"].diagnostics["samples_per_prompt"] = float(cfg.fresh_samples)
    # a logged episode's direct value: its prompt's answers, over every time that prompt was drawn
    at: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        at.setdefault(prompt_id(p), []).append(i)
    nan = float("nan")

    def value(means: np.ndarray, e: LoggedEpisode) -> float:
        idx = at.get(prompt_id(e))
        return float(np.nanmean(means[idx])) if idx and not np.all(np.isnan(means[idx])) else nan

    q = outcome.score(logged)
    v_c = np.array([value(cand, e) for e in logged])
    v_h = np.array([value(champ, e) for e in logged])
    found["doubly_robust"] = doubly_robust(
        v_c,
        v_h,
        np.array([nan if v is None else v for v in q]),
        np.array([e.reward for e in logged]),
        np.array(candidate_logp, dtype=float),
        np.array(champion_logp, dtype=float),
        np.array([sum(e.behavior_logprobs or [nan]) for e in logged]),
        cfg.sequence_ratio_cap,
        cfg.bootstrap,
        cfg.confidence,
        seed,
    )
    return found
