"""Episodes -> token sequences with a loss mask and aligned behaviour log-probs.

    prompt      rendered (chat template for messages) and tokenized: context, mask 0
    completion  text: the served tokens (completion_token_ids) when logged, else re-tokenized;
                trajectory (after chat messages): the whole conversation through the chat
                template (pipeline.core.chat.render_turns), assistant turns carry loss (mask 1, their
                tool calls and end-of-turn token included), the template's headers, tool results
                and user turns are context (mask 0) -- only what the policy wrote is trained
    behaviour   serving-time log-probs, one per assistant token. Used only when they align:
                with the served token ids, their count must match; without ids, the re-tokenized
                count must match. Otherwise they are dropped for that episode and counted --
                never misaligned silently.

An episode that cannot be used is skipped and counted, never fails the run: no assistant token
(empty completion, a trajectory without an assistant turn), served token ids outside the
tokenizer's vocabulary (another model's ids), a prompt the chat template refuses to render.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.chat import render_prompt, render_turns


class Skip(str, enum.Enum):
    EMPTY_COMPLETION = "empty_completion"
    NO_ASSISTANT_TOKENS = "no_assistant_tokens"
    TOKEN_IDS_OUT_OF_VOCABULARY = "token_ids_out_of_vocabulary"
    UNRENDERABLE = "unrenderable"  # the chat template (or the tokenizer) raised on it
    BAD_SAMPLING = "bad_sampling"  # sampling.temperature/top_p/top_k not usable numbers
    TRUNCATED = "truncated"  # the client went away mid-stream: what it saw is not what was generated


@dataclass
class TokenizedEpisode:
    request_id: str
    input_ids: list[int]  # [L] prompt + completion
    loss_mask: list[int]  # [L] 1 on the assistant's tokens
    behavior: list[float] | None  # [L] aligned with input_ids (0.0 off the mask), or None
    behavior_note: str  # "served_ids" | "retokenized" | "missing" | "misaligned"
    temperature: float = 1.0  # the distribution the behaviour log-probs were taken from:
    top_p: float = 1.0  # temperature, then top-k (0: off), then top-p (1.0: off),
    top_k: int = 0  # as pipeline.core.types.SamplingParams
    episode: str | None = None  # the agent episode this call belongs to (None: its own): see advantages()

    def sample_with(self, params: Any) -> None:
        self.temperature, self.top_p, self.top_k = params.temperature, params.top_p, params.top_k


@dataclass
class DataStats:
    episodes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    behavior: dict[str, int] = field(default_factory=dict)  # note -> count

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


def _assistant_segment(msg: dict) -> str:
    content = msg.get("content") if isinstance(msg.get("content"), str) else ""
    calls = msg.get("tool_calls")
    return content + (json.dumps(calls, separators=(",", ":")) if calls else "")


def tokenize_episode(
    tokenizer: Any,
    request_id: str,
    prompt: Any,
    completion: Any,
    completion_token_ids: list[int] | None = None,
    behavior_logprobs: list[float] | None = None,
    stats: DataStats | None = None,
    tools: list[dict] | None = None,
) -> TokenizedEpisode | Skip:
    """`tools`: the tools the prompt offered (the chat template renders them with it)."""
    stats = stats if stats is not None else DataStats()
    try:
        return _tokenize(
            tokenizer, request_id, prompt, completion, completion_token_ids, behavior_logprobs, stats, tools
        )
    except Exception:  # noqa: BLE001 - a template that raises on a role, odd content: this episode only
        stats.count(stats.skipped, Skip.UNRENDERABLE.value)
        return Skip.UNRENDERABLE


def _tokenize(
    tokenizer: Any,
    request_id: str,
    prompt: Any,
    completion: Any,
    completion_token_ids: list[int] | None,
    behavior_logprobs: list[float] | None,
    stats: DataStats,
    tools: list[dict] | None = None,
) -> TokenizedEpisode | Skip:
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    if completion_token_ids and not 0 <= min(completion_token_ids) <= max(completion_token_ids) < len(tokenizer):
        stats.count(stats.skipped, Skip.TOKEN_IDS_OUT_OF_VOCABULARY.value)
        return Skip.TOKEN_IDS_OUT_OF_VOCABULARY
    # a trajectory after chat messages goes through the template whole (the prompt included)
    whole_conversation = (
        not isinstance(completion, str) and isinstance(prompt, list) and tokenizer.chat_template is not None
    )
    ids = [] if whole_conversation else list(encode(render_prompt(tokenizer, prompt, tools)))
    mask = [0] * len(ids)
    if isinstance(completion, str):
        if not completion and not completion_token_ids:
            stats.count(stats.skipped, Skip.EMPTY_COMPLETION.value)
            return Skip.EMPTY_COMPLETION
        served = list(completion_token_ids) if completion_token_ids else None
        completion_ids = served if served is not None else list(encode(completion))
        ids += completion_ids
        mask += [1] * len(completion_ids)
        note = "served_ids" if served is not None else "retokenized"
    elif whole_conversation:
        # every turn through the chat template, as serving renders the conversation for the next call
        turns = [m for m in completion if isinstance(m, dict)] if isinstance(completion, list) else []
        for text, mine in render_turns(tokenizer, prompt, turns, tools):
            piece = encode(text)
            ids += piece
            mask += [int(mine)] * len(piece)
        note = "retokenized"
    else:
        opened = True  # the prompt's generation cue already opened the first assistant turn
        for msg in completion if isinstance(completion, list) else ():
            if not isinstance(msg, dict):
                continue
            if msg.get("role") == "assistant":
                head = [] if opened else encode("assistant: ")
                body = encode(_assistant_segment(msg))
                ids += head + body
                mask += [0] * len(head) + [1] * len(body)
            else:  # tool results and user turns are context the policy did not produce
                ctx = encode(f"{msg.get('role', 'tool')}: {msg.get('content', '')}")
                ids += ctx
                mask += [0] * len(ctx)
            opened = False
            tail = encode("\n")
            ids += tail
            mask += [0] * len(tail)
        note = "retokenized"
    n_assistant = sum(mask)
    if n_assistant == 0:
        stats.count(stats.skipped, Skip.NO_ASSISTANT_TOKENS.value)
        return Skip.NO_ASSISTANT_TOKENS
    behavior = None
    if behavior_logprobs is None:
        note = "missing"
    elif len(behavior_logprobs) != n_assistant:
        note = "misaligned"  # dropped: trained on-policy-approximate, counted
    else:
        values = iter(behavior_logprobs)
        behavior = [next(values) if m else 0.0 for m in mask]
    stats.episodes += 1
    stats.count(stats.behavior, note)
    return TokenizedEpisode(request_id, ids, mask, behavior, note)
