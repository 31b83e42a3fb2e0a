"""A synthetic task the tiny model can learn on a CPU in seconds: reverse a 3-letter string.

    prompt "abc>"   correct completion "cba"   reward 1.0 if correct, else 0.0

The base policy is made to resemble a real one: it knows the format (three letters) but prefers
the wrong behaviour. It is fine-tuned from a random tiny model on a mixture where the answer is
the prompt copied (65 %) or reversed (35 %): greedy decoding copies (accuracy ~0 on
non-palindromes), sampling reverses about a third of the time. Learning from its own logged,
rewarded samples must flip the greedy answer to the reversal.
"""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch

ALPHABET = "abcdef"
PROMPTS = ["".join(p) for p in itertools.product(ALPHABET, repeat=3) if p[0] != p[2]]  # 180, no palindromes


def prompt_text(s: str) -> str:
    return f"{s}>"


def reward(s: str, completion: str) -> float:
    return 1.0 if completion == s[::-1] else 0.0


def split(seed: int = 0, held_out: int = 40) -> tuple[list[str], list[str]]:
    prompts = PROMPTS[:]
    random.Random(seed).shuffle(prompts)
    return prompts[held_out:], prompts[:held_out]


def make_base(out: Path, seed: int = 0, steps: int = 300, p_reverse: float = 0.35) -> Path:
    """Write the base policy to `out` (init-tiny, then the copy/reverse mixture)."""
    from train.models import init_tiny, load_policy

    init_tiny(out, arch="llama", hidden=64, layers=2, heads=4, seed=seed)
    policy = load_policy(out, device="cpu")
    model, tok = policy.model, policy.tokenizer
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = []
        for _ in range(64):
            s = rng.choice(PROMPTS)
            answer = s[::-1] if rng.random() < p_reverse else s
            batch.append(tok(prompt_text(s) + answer, add_special_tokens=False).input_ids)
        ids = torch.tensor(batch)  # [64, 7]: every example has the same length
        logits = model(input_ids=ids).logits[:, :-1]
        # loss on the three answer tokens only (the prompt is given)
        loss = torch.nn.functional.cross_entropy(logits[:, -3:].reshape(-1, logits.size(-1)), ids[:, -3:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out)
    return out


@torch.no_grad()
def generate(
    model, tok, prompts: list[str], greedy: bool, temperature: float = 1.0, generator: torch.Generator | None = None
) -> tuple[list[str], list[list[int]], list[list[float]]]:
    """Three tokens per prompt: (texts, token ids, log-probs at `temperature`)."""
    model.eval()
    ids = torch.tensor([tok(prompt_text(s), add_special_tokens=False).input_ids for s in prompts])  # [N, 4]
    out_ids, out_lp = [], []
    for _ in range(3):
        logits = model(input_ids=ids).logits[:, -1].float() / temperature  # [N, V]
        logp = torch.log_softmax(logits, -1)
        nxt = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
        out_ids.append(nxt)
        out_lp.append(logp.gather(-1, nxt[:, None]).squeeze(-1))
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    token_ids = torch.stack(out_ids, 1).tolist()
    logprobs = torch.stack(out_lp, 1).tolist()
    return [tok.decode(t) for t in token_ids], token_ids, logprobs


def accuracy(model, tok, prompts: list[str]) -> float:
    texts, _, _ = generate(model, tok, prompts, greedy=True)
    return sum(reward(s, c) for s, c in zip(prompts, texts)) / len(prompts)


def sample_episodes(model, tok, prompts: list[str], per_prompt: int, seed: int = 0) -> list[dict]:
    """Logged episodes as serving would emit them: completion, served token ids, log-probs, reward."""
    generator = torch.Generator().manual_seed(seed)
    batch = [s for s in prompts for _ in range(per_prompt)]
    texts, token_ids, logprobs = generate(model, tok, batch, greedy=False, generator=generator)
    return [
        {
            "prompt": prompt_text(s),
            "completion": c,
            "completion_token_ids": t,
            "behavior_logprobs": lp,
            "reward": reward(s, c),
            "group": s,
        }
        for s, c, t, lp in zip(batch, texts, token_ids, logprobs)
    ]


def as_events(episodes: list[dict], prefix: str, start: datetime, tenants: tuple[str, ...] = ("acme",)) -> list[dict]:
    """Each episode as the interaction serving emitted and the test_result feedback that followed."""
    from tests.support.factories import feedback, interaction

    out = []
    for i, e in enumerate(episodes):
        ts = start + timedelta(seconds=i)
        out.append(
            interaction(
                i,
                prefix=prefix,
                ts=_rfc3339(ts),
                tenant=tenants[i % len(tenants)],
                prompt=e["prompt"],
                completion=e["completion"],
                completion_token_ids=e["completion_token_ids"],
                behavior_logprobs=e["behavior_logprobs"],
                sampling={"temperature": 1.0},
            )
        )
        out.append(
            feedback(
                i, prefix=prefix, kind="test_result", value=e["reward"] > 0, ts=_rfc3339(ts + timedelta(seconds=1))
            )
        )
    return out


def _rfc3339(ts: datetime) -> str:
    return ts.astimezone(UTC).isoformat().replace("+00:00", "Z")
