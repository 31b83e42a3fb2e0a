"""A scripted chat model for the serving tests: tools it calls, answers it gives."""

from __future__ import annotations

import time

from train.inference import Generation, PolicySet

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "the word stored under a key",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string"}},
            "required": ["key"],
            "additionalProperties": False,
        },
    },
}


ASK = [{"role": "user", "content": "reverse the word under key k1"}]


class Scripted:
    """A policy that writes `text` (the real tokenizer's tokens of it, then end-of-sequence),
    token by token when streamed, `delay_s` apart."""

    def __init__(self, real: PolicySet, text: str, delay_s: float = 0.0) -> None:
        self.real, self.text, self.delay_s, self.tokenizer = real, text, delay_s, real.tokenizer

    def prompt_tokens(self, prompt, tools=None):
        return self.real.prompt_tokens(prompt, tools)

    def generate(
        self,
        name,
        prompts,
        max_new_tokens=16,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        tools=None,
        on_token=None,
        stop=None,
        **_,
    ):
        ids = self.tokenizer(self.text, add_special_tokens=False).input_ids + [self.tokenizer.eos_token_id]
        out = []
        for i, token in enumerate(ids):
            out.append(token)
            if on_token is not None:
                on_token(token, -0.5 - i / 100)
            # after each token, as generate()'s stopping criteria: a client gone before the
            # first token still gets one (and an empty answer here would end in an IndexError)
            if stop is not None and stop.is_set():
                break
            time.sleep(self.delay_s)
        stopped = out[-1] == self.tokenizer.eos_token_id
        text = self.tokenizer.decode(out[:-1] if stopped else out)
        return [Generation(text, out, [-0.5 - i / 100 for i in range(len(out))], 1.0, stopped)]
