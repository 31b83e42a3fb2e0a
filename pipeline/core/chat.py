"""How a prompt becomes the text a model continues: one rendering for serving, training, the
gate and the judge, so what a stage feeds the model is what serving rendered.

    render_prompt(tok, prompt)        text as it is; chat messages through the tokenizer's chat
                                      template with the generation prompt
    render_turns(tok, prompt, turns)  a whole conversation through the template, cut into the
                                      policy's turns and the context around them

Pure functions of a Hugging Face tokenizer (its `apply_chat_template`); no model library imported.
"""

from __future__ import annotations

from typing import Any


def render_prompt(tokenizer: Any, prompt: str | list[dict]) -> str:
    """Text prompts are used as they are; chat messages go through the chat template."""
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


def render_turns(tokenizer: Any, prompt: list[dict], turns: list[dict]) -> list[tuple[str, bool]]:
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
        before = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        messages.append(turn)
        through = tokenizer.apply_chat_template(messages, tokenize=False)
        if not before.startswith(done) or not through.startswith(before):
            raise ValueError("the chat template does not render a conversation's turns as prefixes of each other")
        written = through[len(before):]
        # the turn ends with the end-of-turn token the policy wrote; what the template puts after
        # it (a newline) is context. A template without one: trailing newlines are context
        eos = tokenizer.eos_token or ""
        end = written.rfind(eos) + len(eos) if eos and eos in written else len(written.rstrip("\n"))
        segments += [(before[len(done):], False), (written[:end], True)]
        done = before + written[:end]
    return [(text, mine) for text, mine in segments if text]
