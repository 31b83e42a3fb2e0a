"""Streaming generation for `rtrl serve`: the pieces generate() takes so that each token reaches
the client as it is sampled, with the log-prob of the distribution it was drawn from, and so that
a client that went away stops the generation.

    StepLogprobs   the last logits processor: each step's log-probs after temperature and top-p
    TokenStream    generate()'s streamer: each sampled token and its log-prob to a callback
    Stopped        a stopping criterion set from outside (the client disconnected)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer


class StepLogprobs(LogitsProcessor):
    """The last step's log-probs over the vocabulary, as the token was drawn (the last processor)."""

    last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.last = torch.log_softmax(scores[0].float(), -1)  # [V] (one prompt)
        return scores


class TokenStream(BaseStreamer):
    """generate()'s streamer: each sampled token and its log-prob to `on_token` (the first
    put is the prompt)."""

    def __init__(self, step: StepLogprobs, on_token: Callable[[int, float], None] | None) -> None:
        self.step, self.on_token, self.prompt_seen = step, on_token, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        if self.on_token is not None:
            token = int(value.reshape(-1)[0])
            self.on_token(token, float(self.step.last[token]))

    def end(self) -> None:
        pass


class Stopped(StoppingCriteria):
    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **_: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stop.is_set(), dtype=torch.bool, device=input_ids.device)
