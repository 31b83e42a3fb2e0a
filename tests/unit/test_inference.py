"""PolicySet: reused results equal fresh ones and leave with their adapter; seeded sampling draws afresh per batch."""

from __future__ import annotations

import torch

from pipeline.core.config import TrainConfig
from pipeline.core.types import LoggedEpisode
from train.inference import PolicySet
from train.lora import attach_adapter, save_adapter
from train.models import init_tiny, load_policy


def _adapter(base, out, seed: int):
    model = attach_adapter(load_policy(base, device="cpu").model, TrainConfig(base_model=base, lora_r=4))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B starts at zero (the adapter is then the base): move it
                p.normal_(0, 0.5)
    return save_adapter(model, out)


def _episodes(prefix: str, n: int) -> list[LoggedEpisode]:
    words = ["abc", "hello", "xyz", "qwerty", "lmnop", "ba"]
    return [
        LoggedEpisode(
            f"{prefix}{i}", f"{words[i % 6]}{prefix[0]}{i}>", words[(i + 1) % 6], temperature=0.7 + 0.1 * (i % 3)
        )
        for i in range(n)
    ]


def test_remembered_distributions_and_greedy_answers_equal_fresh_ones(tmp_path):
    base = init_tiny(tmp_path / "base", seed=1)
    adapters = {"a": _adapter(base, tmp_path / "a", 1), "b": _adapter(base, tmp_path / "b", 2)}
    resident = PolicySet.load(base, device="cpu")
    for name, path in adapters.items():
        resident.add(name, path)
    old, new = _episodes("old-", 30), _episodes("new-", 20)
    resident.compare("a", "b", old)  # the champion "a" has seen the old window
    window = old[10:] + new  # the window slid: 20 remembered, 20 new
    kept = resident.compare("a", "b", window)
    fresh_set = PolicySet.load(base, device="cpu")
    for name, path in adapters.items():
        fresh_set.add(name, path)
    fresh = fresh_set.compare("a", "b", window)
    for got, want in zip(kept[:2], fresh[:2]):
        assert all(abs(x - y) < 1e-4 for x, y in zip(got, want))
    assert kept[2] > 1e-3 and abs(kept[2] - fresh[2]) < 1e-5 * max(1.0, fresh[2])
    # the base model too (None), and the other way round (b's distributions were kept as the candidate's)
    for p, q in ((None, "a"), ("b", "a")):
        assert abs(resident.compare(p, q, window)[2] - fresh_set.compare(p, q, window)[2]) < 1e-5

    calls = []
    real = resident._generate_batch
    resident._generate_batch = lambda prompts, *a: calls.append(len(prompts)) or real(prompts, *a)
    prompts = [e.prompt for e in window]
    first = resident.generate("a", prompts[:25], max_new_tokens=5, batch_size=8, reuse=True)
    again = resident.generate("a", prompts, max_new_tokens=5, batch_size=8, reuse=True)
    assert sum(calls) == 40  # 25, then only the 15 it had not answered
    assert [g.text for g in again[:25]] == [g.text for g in first]
    assert [g.text for g in again] == [g.text for g in fresh_set.generate("a", prompts, max_new_tokens=5, batch_size=8)]
    resident.generate("a", prompts, max_new_tokens=5)  # without reuse (serving, smoke): generated again
    assert sum(calls) == 80

    # an adapter that leaves takes what was remembered of it
    resident.remove("a")
    assert all(key[0] != "a" for key in resident._memo) and all(key[0] != "a" for key in resident._greedy)


def test_compare_on_a_32k_vocabulary_is_reduced_batch_by_batch(bpe_base, tmp_path):
    """The gate's comparison holds at most one batch's [tokens, vocab] distributions (and the
    bounded memo): the batch size is set by LOGITS_ELEMENTS, and the answers do not depend on it."""
    import random

    policies = PolicySet.load(bpe_base, device="cpu")
    policies.add("cand", _adapter(bpe_base, tmp_path / "cand", 3))
    rng, vocab = random.Random(0), len(policies.tokenizer)
    specials = set(policies.tokenizer.all_special_ids)
    episodes = []
    for i in range(12):
        ids = [t for t in (rng.randrange(vocab) for _ in range(60)) if t not in specials][: rng.randint(5, 40)]
        prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {i}"}]
        episodes.append(LoggedEpisode(f"r{i}", prompt, policies.tokenizer.decode(ids), ids, temperature=0.8))
    whole = policies.compare(None, "cand", episodes)

    small = PolicySet(policies.policy)  # the same weights, memory of nothing, batches of 64 tokens
    small.model, small.names = policies.model, policies.names
    small.LOGITS_ELEMENTS, small.MEMO_BYTES = 64 * vocab, 0
    batches, real = [], small._completion_logprobs
    small._completion_logprobs = lambda name, part: batches.append(len(part)) or real(name, part)
    batched = small.compare(None, "cand", episodes)
    assert len(batches) > 2 * 4 and max(batches) <= 2  # at most two episodes of up to ~60 tokens a batch
    for got, want in zip(batched[:2], whole[:2]):
        assert all(abs(x - y) < 1e-3 for x, y in zip(got, want))
    assert whole[2] > 0 and abs(batched[2] - whole[2]) < 1e-4 * max(1.0, whole[2])


def test_sampled_batches_draw_afresh_and_two_policies_share_the_draws(tmp_path):
    """A seeded generate() samples batch after batch: each batch must draw its own randomness (the
    gate's fresh answers are independent samples per prompt), and a second policy answering the
    same prompts with the same seed gets the same draws, batch by batch."""
    base = init_tiny(tmp_path / "base", seed=1)
    policies = PolicySet.load(base, device="cpu")
    prompts = ["abcde>"] * 64
    twice = policies.generate(None, prompts, max_new_tokens=6, temperature=1.0, seed=3, batch_size=32)
    first, second = [g.text for g in twice[:32]], [g.text for g in twice[32:]]
    assert first != second  # the same uniforms row for row would write the same answers
    again = policies.generate(None, prompts, max_new_tokens=6, temperature=1.0, seed=3, batch_size=32)
    assert [g.text for g in again] == first + second
