"""Data-parallel training with torch.distributed.run on CPU (gloo): two processes train the
adapter one process trains with the same global batch, a checkpoint taken by two processes
resumes in two, and a rank that dies fails the run with its reason instead of hanging."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.support.training import CFG, tokenized
from train.distributed import DistributedTrainingError, run_distributed
from train.loop import train_policy
from train.lora import attach_adapter, load_adapter, save_adapter
from train.models import load_policy
from train.tracking import MemoryTracker


@pytest.fixture(scope="module")
def setup(reverse_base, logged_episodes, tmp_path_factory):
    """The base, a saved start adapter (B not zero: every weight moves), 64 logged episodes."""
    out = tmp_path_factory.mktemp("ddp")
    policy = load_policy(reverse_base, device="cpu")
    torch.manual_seed(0)
    model = attach_adapter(policy.model, CFG.model_copy(update={"lora_dropout": 0.0}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)
    start = save_adapter(model, out / "start")
    episodes = logged_episodes[:64]
    return reverse_base, start, episodes, tokenized(policy.tokenizer, episodes, drop_behavior_every=5)


def fresh(eps):
    """A run fills in missing behaviour log-probs in place: each run gets its own copies."""
    return copy.deepcopy(eps)


@pytest.fixture(scope="module")
def logged_episodes(reverse_base):
    from tests.support import reverse_task as task

    policy = load_policy(reverse_base, device="cpu")
    return task.sample_episodes(policy.model, policy.tokenizer, task.split()[0], per_prompt=4, seed=3)


def _lora(path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def _one_process(base, start, episodes, eps, cfg, out):
    policy = load_policy(base, device="cpu")
    model = load_adapter(policy.model, start, trainable=True)
    result = train_policy(
        model,
        eps,
        [e["reward"] for e in episodes],
        [e["group"] for e in episodes],
        cfg,
        MemoryTracker(),
        policy.tokenizer.pad_token_id,
    )
    return result, save_adapter(model, out)


@pytest.mark.parametrize(
    "per_rank, steps, batch_tokens, strategy", [(1, 3, 256, "ddp"), (2, None, 40, "ddp"), (2, None, 40, "fsdp")]
)
def test_two_processes_train_the_adapter_one_process_trains(setup, tmp_path, per_rank, steps, batch_tokens, strategy):
    """grad_accum 1 per rank for 3 steps; and 2 per rank over a whole epoch, whose last step has
    fewer micro-batches than 2 x 2 (the ranks run different numbers of them) -- also with the
    base model's weights sharded over the two (FSDP2), where every forward is a collective."""
    base, start, episodes, eps = setup
    cfg = CFG.model_copy(
        update={
            "lora_dropout": 0.0,
            "epochs": 1,
            "max_steps": steps,
            "batch_tokens": batch_tokens,
            "max_seq_len": min(64, batch_tokens),
            "learning_rate": 1e-2,
            "base_model": base,
            "grad_accum": per_rank,
        }
    )
    if steps is None:
        from train.loop import plan_microbatches

        assert len(plan_microbatches([len(e.input_ids) for e in eps], cfg, 2)) % 4 in (1, 3)
    one, one_dir = _one_process(
        base, start, episodes, fresh(eps), cfg.model_copy(update={"grad_accum": 2 * per_rank}), tmp_path / "one"
    )
    tracker = MemoryTracker()
    seen = []
    two, two_dir = run_distributed(
        tmp_path / "job",
        base,
        start,
        fresh(eps),
        [e["reward"] for e in episodes],
        [e["group"] for e in episodes],
        cfg.model_copy(update={"nproc": 2, "strategy": strategy}),
        tracker,
        on_step=lambda step, total, m: seen.append((step, total)),
    )
    assert two.steps == one.steps and two.tokens == one.tokens
    assert [s for s, _ in tracker.metrics] == list(range(1, one.steps + 1))
    assert seen == [(k, one.steps) for k in range(1, one.steps + 1)]
    for (_, m1), m2 in zip(tracker.metrics, one.history):  # the step's metrics are over both ranks
        assert abs(m1["loss"] - m2["loss"]) < 1e-5 and m1["recomputed_behavior_frac"] == m2["recomputed_behavior_frac"]
    a, b, s = _lora(one_dir), _lora(two_dir), _lora(start)
    assert a.keys() == b.keys() and any(not torch.equal(a[k], s[k]) for k in a)
    for k in a:
        # equal up to the order of float sums: one process adds four micro-batches' gradients, two
        # add two each and average; AdamW divides by sqrt(v), so a coordinate with tiny gradients
        # carries that noise into its update (3e-5 in one of 512 with micro-batches grouped by length)
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-4)
    held = json.loads((tmp_path / "job" / "memory.json").read_text())
    share = held["frozen_held"] / held["frozen_total"]  # of the base model's weights, in rank 0
    assert share == 1.0 if strategy == "ddp" else 0.45 < share < 0.55, held


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_checkpoint_of_two_processes_resumes_in_two(setup, tmp_path, strategy):
    base, start, episodes, eps = setup
    cfg = CFG.model_copy(
        update={
            "lora_dropout": 0.0,
            "epochs": 1,
            "max_steps": 4,
            "batch_tokens": 256,
            "checkpoint_every": 2,
            "nproc": 2,
            "base_model": base,
            "strategy": strategy,
        }
    )
    rewards, groups = [e["reward"] for e in episodes], [e["group"] for e in episodes]
    _, straight = run_distributed(
        tmp_path / "a", base, start, fresh(eps), rewards, groups, cfg, MemoryTracker(), checkpoint_dir=tmp_path / "ckpt"
    )
    ckpt = tmp_path / "ckpt" / "step-2"
    resumed, again = run_distributed(
        tmp_path / "b", base, ckpt / "adapter", fresh(eps), rewards, groups, cfg, MemoryTracker(), resume_from=ckpt
    )
    assert resumed.steps == 4 and len(resumed.history) == 2
    a, b = _lora(straight), _lora(again)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_a_rank_that_dies_fails_the_run_with_its_reason(setup, tmp_path):
    base, start, episodes, eps = setup
    cfg = CFG.model_copy(update={"epochs": 1, "max_steps": 2, "nproc": 2, "base_model": base, "ddp_timeout_s": 30})
    with pytest.raises(DistributedTrainingError) as err:
        run_distributed(
            tmp_path / "job",
            base,
            tmp_path / "no-such-adapter",
            eps,
            [e["reward"] for e in episodes],
            [e["group"] for e in episodes],
            cfg,
            MemoryTracker(),
        )
    assert "failed (launcher exit code" in str(err.value) and "no adapter at" in str(err.value)
