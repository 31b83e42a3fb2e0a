"""How a prompt becomes the text a model continues: one rendering for serving, training, the
gate and the judge, so what a stage feeds the model is what serving rendered.

    render_prompt(tok, prompt, tools)        text as it is; chat messages (and the tools offered)
                                             through the tokenizer's chat template with the
                                             generation prompt
    render_turns(tok, prompt, turns, tools)  a whole conversation through the template, cut into
                                             the policy's turns and the context around them
    parse_tool_calls(text, tools)            the other way: the tool calls a model wrote, in the
                                             Qwen2.5/Hermes convention its template teaches
                                             (<tool_call>{"name", "arguments"}</tool_call>)

Pure functions of a Hugging Face tokenizer (its `apply_chat_template`); no model library imported.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema


def render_prompt(tokenizer: Any, prompt: str | list[dict], tools: list[dict] | None = None) -> str:
    """Text prompts are used as they are; chat messages go through the chat template, with the
    tools offered (OpenAI function schemas) where there are some."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tools=tools or None, tokenize=False, add_generation_prompt=True)


TOOL_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.S)


@dataclass(frozen=True)
class ToolCalls:
    """What a model's text says: `content`, the text outside its tool calls (None when there is
    none), and `calls` in the OpenAI shape ({"id", "type": "function", "function": {"name",
    "arguments": a JSON string}}); a call that does not parse, names no offered tool or whose
    arguments break the tool's schema carries an `error` (and what the model wrote)."""

    content: str | None
    calls: list[dict[str, Any]] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return bool(self.calls) and not any("error" in c for c in self.calls)


def parse_tool_calls(
    text: str, tools: list[dict] | None = None, call_id: Callable[[int], str] = lambda i: f"call_{i}"
) -> ToolCalls:
    """The tool calls in `text`. With `tools` (the OpenAI function schemas offered), a call must
    name one of them and its arguments must validate against its `parameters`; without, any
    named call whose arguments are a JSON object is well formed."""
    offered = {
        t["function"]["name"]: t["function"].get("parameters") or {}
        for t in tools or ()
        if isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"]
    }
    calls = []
    for i, match in enumerate(TOOL_CALL.finditer(text)):
        raw, closed = match.group(1).strip(), bool(match.group(2))
        call: dict[str, Any] = {"id": call_id(i), "type": "function", "function": {"name": "", "arguments": raw}}
        error = None if closed else "unterminated <tool_call>"
        try:
            parsed: Any = json.loads(raw) if error is None else None
        except ValueError:
            parsed, error = None, "not JSON"
        if error is None and not (isinstance(parsed, dict) and isinstance(parsed.get("name"), str) and parsed["name"]):
            error = "no function name"
        if error is None:
            name, args = parsed["name"], parsed.get("arguments", {})
            call["function"] = {"name": name, "arguments": json.dumps(args) if isinstance(args, dict) else str(args)}
            if not isinstance(args, dict):
                error = "arguments are not a JSON object"
            elif tools is not None and name not in offered:
                error = f"{name!r} is not an offered tool"
            elif tools is not None:
                try:
                    jsonschema.validate(args, offered[name])
                except jsonschema.ValidationError as exc:
                    error = f"arguments do not match {name}'s schema: {exc.message}"
                except jsonschema.SchemaError:
                    error = f"{name}'s parameters are not a valid JSON schema"
        if error is not None:
            call["error"] = error
        calls.append(call)
    if not calls:
        return ToolCalls(text)
    rest = TOOL_CALL.sub("", text).strip()
    return ToolCalls(rest or None, calls)


def held_back(text: str) -> int:
    """How much of a streamed `text` can be sent before knowing whether it is a tool call: up
    to its first `<tool_call>`, or to a trailing prefix of one (`<tool` may become one)."""
    start = text.find("<tool_call>")
    if start >= 0:
        return start
    for k in range(min(len("<tool_call>") - 1, len(text)), 0, -1):
        if text.endswith("<tool_call>"[:k]):
            return len(text) - k
    return len(text)


def render_turns(
    tokenizer: Any, prompt: list[dict], turns: list[dict], tools: list[dict] | None = None
) -> list[tuple[str, bool]]:
    """A conversation (`prompt` messages, then the episode's assistant, tool and user `turns`)
    as the chat template renders it, cut into (text, written by the policy) segments: the first
    is exactly what serving rendered for the prompt (`render_prompt`); each assistant turn -- its
    content and tool calls, up to and including the end-of-turn token -- is the policy's; the
    template's text around them (the next turn's header, tool results, user turns) is context.

    Cut by rendering the conversation up to each assistant turn with the generation prompt and
    through it without, and taking differences; a template for which these are not prefixes of
    each other cannot be cut this way: ValueError (the episode is skipped and counted)."""
    messages = list(prompt)
    segments: list[tuple[str, bool]] = []
    done = ""
    for turn in turns:
        if turn.get("role") != "assistant":
            messages.append(turn)
            continue
        before = tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        messages.append(turn)
        through = tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False)
        if not before.startswith(done) or not through.startswith(before):
            raise ValueError("the chat template does not render a conversation's turns as prefixes of each other")
        written = through[len(before) :]
        # the turn ends with the end-of-turn token the policy wrote; what the template puts after
        # it (a newline) is context. A template without one: trailing newlines are context
        eos = tokenizer.eos_token or ""
        end = written.rfind(eos) + len(eos) if eos and eos in written else len(written.rstrip("\n"))
        segments += [(before[len(done) :], False), (written[:end], True)]
        done = before + written[:end]
    return [(text, mine) for text, mine in segments if text]
