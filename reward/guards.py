"""Guards: penalties on what the policy produced, whatever the users said.

Production feedback has blind spots a policy learns to exploit (reported from real
production RL): an abstention or a clarifying question draws no complaint, a broken tool call
is sometimes cheaper than an honest failed attempt. Each guard returns a penalty >= 0 that the
reward subtracts; each is a pure function of the episode and its spec section.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache

from reward.signals import Episode
from reward.spec import AbstentionGuard, Guards, LengthGuard, RepetitionGuard, ToolFormatGuard


def length(ep: Episode, g: LengthGuard) -> float:
    """Characters beyond `max_chars` cost `per_char` each."""
    return max(0, len(ep.text) - g.max_chars) * g.per_char


@lru_cache(maxsize=64)
def _patterns(patterns: tuple[str, ...]) -> list[re.Pattern]:
    return [re.compile(p) for p in patterns]


def is_abstention(text: str, patterns: tuple[str, ...]) -> bool:
    return not text.strip() or any(p.search(text) for p in _patterns(patterns))


def abstention(ep: Episode, g: AbstentionGuard) -> float:
    """An empty output, or one matching a pattern, when an attempt was expected."""
    return g.penalty if ep.expects_attempt and is_abstention(ep.text, g.patterns) else 0.0


def repeated_fraction(text: str, n: int) -> float:
    """Share of word n-grams that repeat an earlier one (0 = none, near 1 = a loop)."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 0.0 if not grams else 1 - len(set(grams)) / len(grams)


def repetition(ep: Episode, g: RepetitionGuard) -> float:
    """Repeated n-grams beyond `max_fraction`, scaled so that a pure loop costs `penalty`."""
    excess = repeated_fraction(ep.text, g.ngram) - g.max_fraction
    return 0.0 if excess <= 0 else g.penalty * excess / max(1 - g.max_fraction, 1e-9)


def _malformed(call: object) -> bool:
    # OpenAI-style {"function": {"name", "arguments"}} or flat {"name", "arguments"}
    if not isinstance(call, dict):
        return True
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        return True
    args = fn.get("arguments", {})
    if isinstance(args, dict):
        return False
    if not isinstance(args, str):
        return True
    try:
        return not isinstance(json.loads(args), dict)
    except ValueError:
        return True


def tool_format(ep: Episode, g: ToolFormatGuard) -> float:
    """Each tool call without a name or with arguments that are not a JSON object."""
    return g.penalty * sum(_malformed(c) for c in ep.tool_calls)


GUARDS: dict[str, Callable[[Episode, Guards], float]] = {
    "length": lambda ep, g: length(ep, g.length),
    "abstention": lambda ep, g: abstention(ep, g.abstention),
    "repetition": lambda ep, g: repetition(ep, g.repetition),
    "tool_format": lambda ep, g: tool_format(ep, g.tool_format),
}
