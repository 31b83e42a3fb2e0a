"""Reward specs: a named, versioned, declarative TOML file.

    name = "default"
    [ripeness]   window_s = 3600, terminal_kinds = ["persisted", "rejected"]
    [join]       orphan_ttl_s = 86400
    [clip]       min = -1.0, max = 1.0
    [signals.<feedback kind>]   weight = 0.5, combine = "last"      # one table per kind
                                half_life_s = 600                   # optional decay by delay
    [guards.length|abstention|repetition|tool_format]                # penalties on the output
    [judge]      model = "/models/judge", weight = 0.5, budget = 1000   # optional
    [episode]    credit = "equal" | "discounted", gamma = 0.9, window_s = 3600  # agent episodes

A spec's version is its name plus a hash of its canonical content, so two files that say the
same thing have the same version and any change makes a new one; every reward row records it.
A malformed spec is refused with the file, the field and what is allowed, before any reward
is written.
"""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DEFAULT_SPEC = Path(__file__).with_name("default_spec.toml")


class SpecError(ValueError):
    """A reward spec is malformed; the message names the file, the field and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Signal(_Strict):
    """How one feedback kind contributes: weight x combine(per-event values), each event's value
    decayed by its delay after the interaction when `half_life_s` is set."""

    weight: float = Field(ge=0, le=10)  # the sign is the signal's; the weight says how much
    combine: Literal["last", "sum", "max", "min", "mean"] = "last"
    # an event this long after the interaction counts half, twice as long a quarter: the later an
    # outcome, the less it says about this completion (see reward.signals.decayed)
    half_life_s: float | None = Field(default=None, gt=0, le=365 * 86400)


# Fields added to a spec after its first release: they enter the version hash only when set, so
# an upgrade of rtrl leaves the version of every existing spec -- and its stored rewards -- alone.
_LATER_FIELDS = {"signals": ("half_life_s",)}
LATER_JUDGE_FIELDS = {"chat": False, "device": "auto"}  # the same, for [judge]: left out at these values


class Ripeness(_Strict):
    window_s: float = Field(default=3600, gt=0, le=30 * 86400)
    terminal_kinds: tuple[str, ...] = ("persisted", "rejected")


class Join(_Strict):
    # feedback whose interaction has not arrived after this long is reported as orphaned
    orphan_ttl_s: float = Field(default=86400, gt=0)


class Clip(_Strict):
    min: float = Field(default=-1.0, ge=-100, le=0)
    max: float = Field(default=1.0, ge=0, le=100)


class LengthGuard(_Strict):
    max_chars: int = Field(default=4000, ge=1)
    per_char: float = Field(default=0.0001, ge=0, le=1)  # penalty per character over max_chars


class AbstentionGuard(_Strict):
    penalty: float = Field(default=0.6, ge=0, le=10)
    # a completion matching any pattern (or empty) is an abstention
    patterns: tuple[str, ...] = ()

    @field_validator("patterns")
    @classmethod
    def _compile(cls, patterns: tuple[str, ...]) -> tuple[str, ...]:
        for p in patterns:
            try:
                re.compile(p)
            except re.error as exc:
                raise ValueError(f"pattern {p!r} is not a regular expression: {exc}") from None
        return patterns


class RepetitionGuard(_Strict):
    ngram: int = Field(default=4, ge=1, le=16)
    max_fraction: float = Field(default=0.3, ge=0, le=1)  # repeated n-grams allowed
    penalty: float = Field(default=0.5, ge=0, le=10)  # times the excess fraction / (1 - max)


class ToolFormatGuard(_Strict):
    penalty: float = Field(default=0.5, ge=0, le=10)  # per malformed tool call


class JudgeSpec(_Strict):
    """A local causal LM prompted as a judge; its score is P(yes) / (P(yes) + P(no)) for the
    next token after the template, contributing weight x (2 * score - 1)."""

    model: str = Field(min_length=1, description="path of a local Hugging Face causal LM directory")
    weight: float = Field(default=0.5, ge=0, le=10)
    template: str = (
        "Request:\n{prompt}\n\nResponse:\n{completion}\n\n"
        "Is the response correct and helpful? Answer yes or no.\nAnswer:"
    )
    yes: str = " yes"
    no: str = " no"
    budget: int = Field(default=1000, ge=0, description="new judge calls per run; the rest wait")
    batch_size: int = Field(default=8, ge=1, le=256)
    max_tokens: int = Field(default=1024, ge=16, description="longer inputs keep their end")
    chat: bool = Field(
        default=False,
        description="ask in a user turn of the judge model's chat template "
        "(pipeline/core/chat.py, as serving renders prompts): for an "
        "instruction-tuned judge",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="as train.device")

    @field_validator("template")
    @classmethod
    def _placeholders(cls, template: str) -> str:
        if "{prompt}" not in template or "{completion}" not in template:
            raise ValueError("must contain {prompt} and {completion}")
        return template


class EpisodeCredit(_Strict):
    """How the outcome of an agent episode (feedback naming its `episode_id`) is credited to its
    calls, and when an episode is ripe. Each call's reward is its own (its feedback, its guards:
    a malformed tool call in step 3 penalises step 3) plus its share of the episode's outcome,
    scored with the same signals: the whole outcome (`equal`, as Agent Lightning and AReaL's
    online mode credit every call), or gamma ** (calls after it) of it (`discounted`: the last
    call gets all of it). An episode is ripe when a terminal kind of its outcome arrived, or
    `window_s` after its last call (default: ripeness.window_s)."""

    credit: Literal["equal", "discounted"] = "equal"
    gamma: float = Field(default=0.9, gt=0, le=1)
    window_s: float | None = Field(default=None, gt=0, le=30 * 86400)


class Guards(_Strict):
    length: LengthGuard = LengthGuard()
    abstention: AbstentionGuard = AbstentionGuard()
    repetition: RepetitionGuard = RepetitionGuard()
    tool_format: ToolFormatGuard = ToolFormatGuard()


class RewardSpec(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    ripeness: Ripeness = Ripeness()
    join: Join = Join()
    clip: Clip = Clip()
    signals: dict[str, Signal] = Field(min_length=1)
    guards: Guards = Guards()
    judge: JudgeSpec | None = None
    episode: EpisodeCredit | None = None  # None: equal credit, ripe ripeness.window_s after the last call

    @model_validator(mode="after")
    def _clip_ordered(self) -> RewardSpec:
        if self.clip.min >= self.clip.max:
            raise ValueError("clip.min must be below clip.max")
        return self

    @property
    def version(self) -> str:
        """`name@hash`: the hash of the canonical content, stable across formatting."""
        content = self.model_dump(mode="json")
        for section, fields in _LATER_FIELDS.items():
            for entry in content[section].values():
                for name in fields:
                    if entry[name] is None:
                        del entry[name]
        if content["episode"] is None:  # added after the first release: see _LATER_FIELDS
            del content["episode"]
        for name, default in LATER_JUDGE_FIELDS.items():
            if content.get("judge") and content["judge"][name] == default:
                del content["judge"][name]
        canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return f"{self.name}@{hashlib.sha256(canonical.encode()).hexdigest()[:12]}"


def parse_spec(text: str, source: str = "<spec>") -> RewardSpec:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    try:
        return RewardSpec.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"]) or "<spec>"
            got = f" (got {err['input']!r})" if err["type"] not in ("missing",) else ""
            lines.append(f"  {field}: {err['msg']}{got}")
        raise SpecError(f"{source}: invalid reward spec:\n" + "\n".join(lines)) from None


def load_spec(path: str | Path | None = None) -> RewardSpec:
    """Load a spec file; without a path, the default spec shipped with rtrl."""
    path = Path(path) if path else DEFAULT_SPEC
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise SpecError(f"{path}: reward spec file does not exist") from None
    return parse_spec(text, str(path))
