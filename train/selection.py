"""The episodes a training run learns from: which rewards it selects, how many of them are new,
and each one tokenized as it was served.

    select               rewards of the spec created after the parent's watermark (the newest reward
                         its run read), served within the staleness budget, optionally one tenant,
                         outside the held-out slice (pipeline/core/store/training.py)
    unseen_episodes      how many of them no candidate trained from the same champion has seen
    tokenize_selection   assistant-only loss masks, behaviour log-probs aligned or dropped
                         (train/data.py); what is skipped is counted, never silently dropped
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

import orjson
from sqlalchemy import Engine

from pipeline.core.config import TrainConfig
from pipeline.core.store.events import utcnow
from pipeline.core.store.training import Selection, latest_finished_run, select_episodes
from pipeline.core.types import sampling_params, task_key
from train.data import Skip, TokenizedEpisode, tokenize_episode

if TYPE_CHECKING:  # train/run.py imports this module
    from train.run import Parent, TrainReport


def select(
    engine: Engine,
    cfg: TrainConfig,
    spec_version: str,
    parent: Parent | None,
    now: datetime | None = None,
    since: int | None = None,
) -> Selection:
    watermark = since if since is not None else (parent.watermark if parent else 0)
    served_after = (now or utcnow()) - timedelta(seconds=cfg.staleness_s) if cfg.staleness_s else None
    return select_episodes(
        engine,
        spec_version,
        since_reward_id=watermark,
        served_after=served_after,
        tenant=cfg.tenant,
        limit=cfg.max_episodes,
        holdout_percent=cfg.holdout_percent,
    )


def unseen_episodes(engine: Engine, spec_version: str, selection: Selection) -> tuple[int, str]:
    """How many selected episodes no candidate trained from the same champion has seen, and
    since which run ("" when none was). A candidate trained from this champion that was not
    promoted (or was rolled back) leaves its episodes selectable, which is right, but training
    again on them alone would register a near-copy of a rejected candidate; the caller trains
    only once enough are new. A run of a cycle that failed (before its gate decided, or before
    its promotion) does not count: that cycle is retried with the same episodes."""
    last = latest_finished_run(engine, spec_version, watermark_from=selection.watermark_from, skip_failed_cycles=True)
    if last is None:
        return selection.counts["selected"], ""
    return (
        sum(1 for r in selection.rows if r.reward_id > last.watermark_to),
        f" since run {last.run_id[:12]} (the last candidate trained from this champion)",
    )


def tokenize_selection(
    tokenizer: Any, selection: Selection, cfg: TrainConfig, report: TrainReport
) -> tuple[list[TokenizedEpisode], list[Any], list[str]]:
    """Tokenized episodes, the selection rows they came from, and each one's group (episodes of
    the same task -- first user message -- for group-relative advantages); skips counted in `report`."""
    episodes, rows, groups = [], [], []
    for row in selection.rows:
        try:
            ev = orjson.loads(row.body)
        except orjson.JSONDecodeError:
            report.unreadable += 1
            continue
        if ev.get("truncated"):
            report.data.count(report.data.skipped, Skip.TRUNCATED.value)
            continue
        try:
            sampling = sampling_params(ev.get("sampling"))
        except ValueError:
            report.data.count(report.data.skipped, Skip.BAD_SAMPLING.value)
            continue
        out = tokenize_episode(
            tokenizer,
            row.request_id,
            ev.get("prompt", ""),
            ev.get("completion", ""),
            ev.get("completion_token_ids"),
            ev.get("behavior_logprobs"),
            report.data,
            tools=ev.get("tools"),
        )
        if isinstance(out, Skip):
            continue
        if len(out.input_ids) > cfg.max_seq_len:
            report.too_long += 1
            continue
        out.sample_with(sampling)
        episode = ev.get("episode_id")
        out.episode = episode if isinstance(episode, str) else None
        episodes.append(out)
        rows.append(row)
        task = selection.tasks.get(row.request_id)  # its episode's task, for an agent's call
        groups.append(hashlib.sha1(task if task is not None else task_key(ev.get("prompt", ""))).hexdigest())
    return episodes, rows, groups
