"""A judge hook (generative reward model): a local causal LM asked whether a response is good.

The score is read from the model's next-token distribution after the prompt, not parsed from
generated text:

    score = P(yes) / (P(yes) + P(no))        at the position after the template   # in (0, 1)

so it is deterministic, cheap (one forward pass, no sampling) and never fails to parse.
Scores are cached in the store per (episode, judge version); the version covers the judge's
spec section and the model's config, so changing either re-scores. Nothing is downloaded: the
model is a local directory.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.core.chat import render_prompt
from reward.signals import Episode
from reward.spec import LATER_JUDGE_FIELDS, JudgeSpec


class JudgeError(RuntimeError):
    """The judge model cannot be loaded or used; the message names the path."""


def judge_version(spec: JudgeSpec) -> str:
    model_dir = Path(spec.model)
    try:
        config = (model_dir / "config.json").read_bytes()
    except FileNotFoundError:
        raise JudgeError(f"judge model {model_dir} has no config.json: is it a Hugging Face model directory?") from None
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    # fields added later count only when set, so an upgrade keeps existing judges' cached scores
    unset = {name for name, default in LATER_JUDGE_FIELDS.items() if getattr(spec, name) == default}
    digest = hashlib.sha256(spec.model_dump_json(exclude=unset).encode() + config + json.dumps(weights).encode())
    return f"judge@{digest.hexdigest()[:12]}"


class Judge:
    """Loads the model on first use; `score` returns one score per episode, in order."""

    def __init__(self, spec: JudgeSpec):
        self.spec = spec
        self.version = judge_version(spec)
        self._model = self._tokenizer = None
        self._chat = False  # set when the model is loaded: whether it has a chat template to ask in

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = ("cuda" if torch.cuda.is_available() else "cpu") if self.spec.device == "auto" else self.spec.device
        try:
            tok = AutoTokenizer.from_pretrained(self.spec.model, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(self.spec.model, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise JudgeError(f"cannot load judge model {self.spec.model}: {exc}") from None
        tok.padding_side = "left"  # the answer position is then the last one in every row
        tok.truncation_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        ids = []
        for word in (self.spec.yes, self.spec.no):
            enc = tok.encode(word, add_special_tokens=False)
            if not enc:
                raise JudgeError(f"judge answer {word!r} is not a token of {self.spec.model}")
            ids.append(enc[0])
        if ids[0] == ids[1]:
            raise JudgeError(f"judge answers {self.spec.yes!r} and {self.spec.no!r} map to one token")
        self._answer_ids = torch.tensor(ids)
        self._device = device
        self._chat = self.spec.chat and tok.chat_template is not None
        self._model, self._tokenizer = model.to(self._device).eval(), tok

    def prompt(self, ep: Episode) -> str:
        """The question (the spec's template), in a user turn of the judge's chat template when
        it has one: an instruction-tuned judge is asked the way it was trained to be."""
        if self._model is None:
            self._load()
        question = self.spec.template.format(prompt=ep.prompt_text, completion=ep.text)
        return render_prompt(self._tokenizer, [{"role": "user", "content": question}]) if self._chat else question

    def score(self, episodes: list[Episode]) -> list[float]:
        import torch

        if self._model is None:
            self._load()
        out: list[float] = []
        for start in range(0, len(episodes), self.spec.batch_size):
            texts = [self.prompt(ep) for ep in episodes[start : start + self.spec.batch_size]]
            enc = self._tokenizer(
                texts,
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.spec.max_tokens,
                add_special_tokens=not self._chat,
            ).to(self._device)  # a template writes its own
            with torch.no_grad():
                logits = self._model(**enc).logits[:, -1, :]  # [B, V] at the answer position
            pair = logits[:, self._answer_ids.to(self._device)].float()  # [B, 2]: yes, no
            out.extend(torch.softmax(pair, dim=-1)[:, 0].tolist())  # P(yes) / (P(yes) + P(no))
        return out
