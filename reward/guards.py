"""Guards: penalties on what the policy produced, whatever the users said.

Production feedback has blind spots a policy learns to exploit (reported from real
production RL): an abstention or a clarifying question draws no complaint, a broken tool call
is sometimes cheaper than an honest failed attempt. Each guard returns a penalty >= 0 that the
reward subtracts; each is a pure function of the episode and its spec section.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pipeline.core.textchecks import is_abstention, malformed_tool_call, repeated_fraction
from reward.signals import Episode
from reward.spec import AbstentionGuard, LengthGuard, RepetitionGuard, ToolFormatGuard


def length(ep: Episode, g: LengthGuard) -> float:
    """Characters beyond `max_chars` cost `per_char` each."""
    return max(0, len(ep.text) - g.max_chars) * g.per_char


def abstention(ep: Episode, g: AbstentionGuard) -> float:
    """An empty output, or one matching a pattern, when an attempt was expected."""
    return g.penalty if ep.expects_attempt and is_abstention(ep.text, g.patterns) else 0.0


def repetition(ep: Episode, g: RepetitionGuard) -> float:
    """Repeated n-grams beyond `max_fraction`, scaled so that a pure loop costs `penalty`."""
    excess = repeated_fraction(ep.text, g.ngram) - g.max_fraction
    return 0.0 if excess <= 0 else g.penalty * excess / max(1 - g.max_fraction, 1e-9)


def tool_format(ep: Episode, g: ToolFormatGuard) -> float:
    """Each tool call without a name or with arguments that are not a JSON object."""
    if not ep.tool_calls:
        return 0.0
    return g.penalty * sum(malformed_tool_call(c) for c in ep.tool_calls)


# name -> guard; each is called with the spec's section of the same name (spec.guards.<name>)
GUARDS: dict[str, Callable[[Episode, Any], float]] = {
    "length": length,
    "abstention": abstention,
    "repetition": repetition,
    "tool_format": tool_format,
}
