"""Pure checks on what a policy wrote, shared by the reward guards (reward/guards.py) and the
deployment canaries (deploy/canaries.py): the same definition of "abstained", "looped" and
"broke a tool call" when an episode is rewarded and when a candidate is gated.

Standard library only: every stage may depend on it.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache


@lru_cache(maxsize=64)
def _patterns(patterns: tuple[str, ...]) -> list[re.Pattern]:
    return [re.compile(p) for p in patterns]


def is_abstention(text: str, patterns: tuple[str, ...]) -> bool:
    """Empty, or matching one of the patterns (e.g. a clarifying question instead of an attempt)."""
    if not text or text.isspace():
        return True
    for pattern in _patterns(patterns):
        if pattern.search(text):
            return True
    return False


def repeated_fraction(text: str, n: int) -> float:
    """Share of word n-grams that repeat an earlier one (0 = none, near 1 = a loop)."""
    words = text.split()
    count = len(words) - n + 1  # n-grams in the text
    if count < 2:  # one n-gram or none: nothing to repeat
        return 0.0
    if len(set(words)) == len(words):  # no word repeats, so no n-gram can (most short outputs)
        return 0.0
    distinct = set(zip(*[words[i:] for i in range(n)]))  # zip stops at the shortest: `count` n-grams
    return 1 - len(distinct) / count


def malformed_tool_call(call: object) -> bool:
    """OpenAI-style {"function": {"name", "arguments"}} or flat {"name", "arguments"}: a call
    without a name, or whose arguments are not a JSON object, is malformed."""
    if not isinstance(call, dict):
        return True
    if call.get("error"):  # the server that parsed it said why (pipeline.core.chat.parse_tool_calls)
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
