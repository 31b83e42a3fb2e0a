"""The served tokens' log-probs are recomputed under the distribution they were drawn from
(temperature, top-k, top-p): against transformers' own logits warpers, and end to end from a
top-p generation to training's log-probs with the same adapter."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from pipeline.core.types import LoggedEpisode, SamplingParams, sampling_params
from train.batches import collate
from train.data import tokenize_episode
from train.inference import PolicySet
from train.logprobs import token_logprobs
from train.lora import load_adapter
from train.models import load_policy
from train.sampling import SamplingRows, sampled_logprobs


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 0.9), (0.7, 0, 0.5), (1.3, 20, 1.0), (0.8, 50, 0.95), (1.0, 0, 1.0)]
)
def test_matches_transformers_warpers(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3  # [M, V]
    warpers = [TemperatureLogitsWarper(temperature)]
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    processed = LogitsProcessorList(warpers)(None, logits.clone())
    want_dist = torch.log_softmax(processed, -1)
    targets = torch.multinomial(want_dist.exp(), 1).squeeze(-1)  # [M] sampled as transformers does
    want = want_dist.gather(-1, targets[:, None]).squeeze(-1)
    got = sampled_logprobs(logits / temperature, targets, torch.full((64,), top_p), torch.full((64,), top_k))
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_the_served_token_keeps_its_probability_and_gradients_flow():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]], requires_grad=True)
    outside = torch.tensor([3])  # not in the 0.9-nucleus: a recomputation may differ in the last bits
    logp = sampled_logprobs(logits, outside, torch.tensor([0.9]), torch.tensor([0]))
    assert torch.isfinite(logp).all()
    logp.sum().backward()
    assert logits.grad is not None and logits.grad[0, 2] == 0  # tokens outside K get no gradient


def test_sampling_params_from_events():
    assert sampling_params(None) == SamplingParams()
    assert sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": -1}) == SamplingParams(0.7, 0.9, 0)
    assert sampling_params({"temperature": 0, "top_p": 0.5}) == SamplingParams()  # greedy
    for bad in ({"temperature": "auto"}, {"temperature": 1, "top_p": [0.9]}, {"temperature": 1, "top_k": 2.5}):
        with pytest.raises(ValueError):
            sampling_params(bad)


def test_top_p_served_log_probs_are_what_training_recomputes(bpe_base, tmp_path):
    """Serve with temperature 0.7 and top-p 0.9, then recompute the served tokens' log-probs in
    training with the same adapter: mean |log ratio| per token below 1e-3. Temperature alone
    (what training did before) is visibly off."""
    from tests.support.adapters import make_adapter

    adapter = make_adapter(bpe_base, tmp_path / "adapter", seed=4, std=0.05)
    server = PolicySet.load(bpe_base, device="cpu")
    server.add("1", adapter)
    prompts = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question number {i}"}]
        for i in range(8)
    ]
    served = [
        server.generate("1", [p], max_new_tokens=24, temperature=0.7, top_p=0.9, seed=i)[0]
        for i, p in enumerate(prompts)
    ]

    trainer = load_policy(bpe_base, device="cpu")
    trained = load_adapter(trainer.model, adapter, adapter_name="default", trainable=True)
    trained.eval()
    params = SamplingParams(0.7, 0.9, 0)
    episodes = []
    for i, (prompt, gen) in enumerate(zip(prompts, served)):
        ep = tokenize_episode(trainer.tokenizer, f"r{i}", prompt, gen.text, gen.token_ids, gen.logprobs)
        ep.sample_with(params)
        episodes.append(ep)
    batch = collate(episodes, list(range(len(episodes))), trainer.tokenizer.pad_token_id, "cpu")
    behavior, mask = batch.behavior, batch.mask.bool()  # [B, T]
    with torch.no_grad():
        exact = token_logprobs(trained, batch, SamplingRows.of(episodes))[0]
        plain = token_logprobs(
            trained, batch, SamplingRows.of([LoggedEpisode("x", "", "", temperature=0.7)] * len(episodes))
        )[0]
    assert int(mask.sum()) > 100
    assert float((exact - behavior)[mask].abs().mean()) < 1e-3
    assert float((plain - behavior)[mask].abs().mean()) > 1e-2  # what a temperature-only ratio sees

    # the gate reads the same: sequence log-probs of the logged episodes under the serving adapter
    logged = [
        LoggedEpisode(f"r{i}", p, g.text, g.token_ids, g.logprobs, 0.7, 0.0, 0.9, 0)
        for i, (p, g) in enumerate(zip(prompts, served))
    ]
    for seq, gen in zip(server.sequence_logprobs("1", logged), served):
        assert abs(seq - sum(gen.logprobs)) < 1e-3 * len(gen.logprobs)
