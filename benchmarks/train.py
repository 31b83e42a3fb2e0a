"""Training-step throughput and peak memory: rtrl's loop against a bare torch + peft loop and
TRL's GRPOTrainer, on the same model, the same episodes, the same LoRA and the same loss (CISPO).

    .venv/bin/python benchmarks/train.py                     # CPU figures (docs/benchmarks.md)
    .venv/bin/python benchmarks/train.py --hidden 512 --layers 8 --steps 12   # a bigger model
    .venv/bin/python benchmarks/train.py --variants rtrl --busy-cores 1 --threads 1   # a shared CPU
    python benchmarks/train.py --shape qwen2-0.5b --device cuda --steps 8 --repeats 1   # on a GPU (bf16)
    python benchmarks/train.py --shape qwen2-0.5b --device cuda --variants rtrl-ddp --nproc 2  # two GPUs

`--shape qwen2-0.5b` is Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads / 2 KV heads, MLP 4864,
151,936 embedding rows) with random weights; on CUDA it loads in bf16 (LoRA parameters float32).
`rtrl-ddp` is rtrl's loop in `--nproc` data-parallel processes (train.nproc, torch.distributed.run);
its tokens/s counts every rank's tokens. `rtrl-fsdp` is the same with the base model's weights
split over the processes (train.strategy = "fsdp", FSDP2).

`--busy-cores N` keeps N other processes spinning while the variants run (serving next to the
daemon, as in the demo); `--threads N` is `train.cpu_threads` (torch's intra-op threads).

Each variant runs in its own process (peak memory is per process) on a model made by
`init_tiny` and synthetic logged episodes of fixed length (prompt + completion tokens), with
behaviour log-probs and 4 samples per prompt. tokens/s counts the tokens of every trained
sequence (prompt and completion) per second of optimizer steps, after one warm-up step.

Peak memory: on CUDA the allocator's peak; on CPU the process's peak RSS, and how far it rose
above the RSS once the model was loaded (what the training step itself costs).

    rtrl   train.loop.train_policy (correction, metrics, entropy, all of it)
    bare   the same batches through forward -> CISPO loss -> backward -> AdamW, nothing else
    trl    GRPOTrainer(loss_type="cispo") fed the logged episodes through `rollout_func`
           (TRL's way to train on completions it did not generate). Without vLLM TRL does not
           use the served log-probs (its ratio is 1), so it does a little less work per token.
           Gradient checkpointing off (TRL's default is on), as in the other two.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.core.config import TrainConfig  # noqa: E402
from train.data import tokenize_episode  # noqa: E402
from train.lora import attach_adapter, target_modules  # noqa: E402
from train.models import init_tiny, load_policy, set_cpu_threads  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def episodes(n: int, prompt_len: int, completion_len: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for p in range(n // 4):
        prompt = "".join(rng.choice(LETTERS) for _ in range(prompt_len - 1)) + ">"
        for _ in range(4):
            completion = "".join(rng.choice(LETTERS) for _ in range(completion_len))
            out.append(
                {
                    "prompt": prompt,
                    "completion": completion,
                    "group": str(p),
                    "behavior": [-rng.uniform(0.5, 5.0) for _ in range(completion_len)],
                    "reward": rng.gauss(0, 1),
                }
            )
    return out


def config(args) -> TrainConfig:
    seq = args.prompt + args.completion
    return TrainConfig(
        loss="cispo",
        learning_rate=1e-4,
        max_steps=args.steps,
        batch_tokens=args.batch * seq,
        max_seq_len=seq,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.0,
        epochs=1,
    )


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peak_memory_mb(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else rss_mb()


def run_rtrl(policy, eps, cfg, args) -> tuple[float, int]:
    from train.loop import train_policy
    from train.tracking import MemoryTracker

    tok = [
        tokenize_episode(policy.tokenizer, str(i), e["prompt"], e["completion"], None, e["behavior"])
        for i, e in enumerate(eps)
    ]
    torch.manual_seed(0)
    model = attach_adapter(policy.model, cfg)
    tracker = MemoryTracker()
    result = train_policy(
        model, tok, [e["reward"] for e in eps], [e["group"] for e in eps], cfg, tracker, policy.tokenizer.pad_token_id
    )
    # the loop times each step itself; drop the warm-up step
    steps = result.history[1:]
    tokens = sum(args.batch * (args.prompt + args.completion) for _ in steps)
    seconds = sum(args.batch * (args.prompt + args.completion) / m["tokens_per_s"] for m in steps)
    return seconds, tokens


def run_bare(policy, eps, cfg, args) -> tuple[float, int]:
    from train.batches import collate
    from train.importance import advantages
    from train.loop import plan_microbatches

    tok = [
        tokenize_episode(policy.tokenizer, str(i), e["prompt"], e["completion"], None, e["behavior"])
        for i, e in enumerate(eps)
    ]
    torch.manual_seed(0)
    model = attach_adapter(policy.model, cfg)
    adv = advantages([e["reward"] for e in eps], [e["group"] for e in eps]).to(policy.device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.learning_rate)
    seconds, tokens = 0.0, 0
    for step, index in enumerate(plan_microbatches([len(t.input_ids) for t in tok], cfg)):
        t0 = time.perf_counter()
        b = collate(tok, index, policy.tokenizer.pad_token_id, policy.device)
        logits = model(input_ids=b.input_ids, attention_mask=b.attention).logits[:, :-1].float()
        logp = logits.gather(-1, b.input_ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(logits, -1)
        weight = torch.clamp(torch.exp(logp - b.behavior), max=cfg.cispo_weight_cap).detach()
        loss = (-weight * adv[index][:, None] * logp * b.mask).sum() / b.mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if policy.device == "cuda":
            torch.cuda.synchronize()
        if step:  # warm-up step excluded
            seconds += time.perf_counter() - t0
            tokens += b.tokens
    return seconds, tokens


def run_trl(policy, eps, cfg, args) -> tuple[float, int]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tok = policy.tokenizer
    by_prompt: dict[str, list[dict]] = {}
    for e in eps:
        by_prompt.setdefault(e["prompt"], []).append(e)

    def rollout(prompts, trainer):  # the logged completions, as if just generated
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "logged_reward": []}
        # one logged completion per prompt occurrence (TRL repeats each prompt num_generations times)
        seen: dict[str, int] = {}
        for p in prompts:
            k = seen[p] = seen.get(p, -1) + 1
            for e in by_prompt[p][k : k + 1] if prompts.count(p) > 1 else by_prompt[p]:
                out["prompt_ids"].append(tok(p, add_special_tokens=False).input_ids)
                out["completion_ids"].append(tok(e["completion"], add_special_tokens=False).input_ids)
                out["logprobs"].append(e["behavior"])
                out["logged_reward"].append(e["reward"])  # extra fields reach the reward functions
        return out

    def logged_reward(prompts, completions, logged_reward, **_):
        return list(logged_reward)

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if policy.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    prompts = list(by_prompt)
    with tempfile.TemporaryDirectory() as out:
        args_trl = GRPOConfig(
            output_dir=out,
            loss_type="cispo",
            epsilon_high=cfg.cispo_weight_cap,
            beta=0.0,
            learning_rate=1e-4,
            per_device_train_batch_size=args.batch,
            num_generations=4,
            max_steps=args.steps,
            max_completion_length=args.completion,
            gradient_accumulation_steps=1,
            max_grad_norm=1.0,
            report_to=[],
            logging_steps=10_000,
            save_strategy="no",
            seed=0,
            use_cpu=policy.device == "cpu",
            bf16=False,
            shuffle_dataset=False,
            gradient_checkpointing=False,
        )  # TRL's default is True: like for like, rtrl does not checkpoint
        lora = LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=0.0,
            bias="none",
            target_modules=target_modules(policy.model, cfg),
            task_type="CAUSAL_LM",
        )
        trainer = GRPOTrainer(
            model=policy.model,
            reward_funcs=logged_reward,
            args=args_trl,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            peft_config=lora,
            rollout_func=rollout,
            callbacks=[Timer()],
        )
        trainer.train()
    steps = times[1:]
    return sum(steps), len(steps) * args.batch * (args.prompt + args.completion)


def run_rtrl_ddp(policy, eps, cfg, args) -> tuple[float, int]:
    from train.distributed import run_distributed
    from train.lora import save_adapter
    from train.tracking import MemoryTracker

    tok = [
        tokenize_episode(policy.tokenizer, str(i), e["prompt"], e["completion"], None, e["behavior"])
        for i, e in enumerate(eps)
    ]
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        start = save_adapter(attach_adapter(policy.model, cfg), Path(tmp) / "start")
        ddp_cfg = cfg.model_copy(update={"nproc": args.nproc, "device": args.device, "strategy": args.strategy})
        result, _ = run_distributed(
            Path(tmp) / "job",
            Path(args.model),
            start,
            tok,
            [e["reward"] for e in eps],
            [e["group"] for e in eps],
            ddp_cfg,
            MemoryTracker(),
        )
    steps = result.history[1:]
    per_step = args.batch * (args.prompt + args.completion)
    return sum(per_step / m["tokens_per_s"] for m in steps), per_step * len(steps)


VARIANTS = {"rtrl": run_rtrl, "bare": run_bare, "trl": run_trl, "rtrl-ddp": run_rtrl_ddp, "rtrl-fsdp": run_rtrl_ddp}
SHAPES = {
    "tiny": {},
    "qwen2-0.5b": {
        "arch": "qwen2",
        "hidden": 896,
        "layers": 24,
        "heads": 14,
        "kv_heads": 2,
        "intermediate": 4864,
        "model_vocab": 151_936,
    },
}


def child(args) -> None:
    set_cpu_threads(args.threads)
    args.strategy = "fsdp" if args.only == "rtrl-fsdp" else "ddp"
    policy = load_policy(args.model, device=None if args.device == "auto" else args.device)
    eps = episodes(args.episodes, args.prompt, args.completion)
    cfg = config(args)
    if policy.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    before = rss_mb()
    seconds, tokens = VARIANTS[args.only](policy, eps, cfg, args)
    print(
        json.dumps(
            {
                "variant": args.only,
                "tokens_per_s": tokens / seconds,
                "tokens": tokens,
                "seconds": seconds,
                "peak_mb": peak_memory_mb(policy.device),
                "rss_before_mb": before,
                "device": policy.device,
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per episode")
    ap.add_argument("--completion", type=int, default=192, help="completion tokens per episode")
    ap.add_argument("--batch", type=int, default=16, help="episodes per optimizer step")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=5, help="runs per variant; the median is reported")
    ap.add_argument("--variants", default="bare,rtrl,trl")
    ap.add_argument("--threads", type=int, help="torch threads (train.cpu_threads); default: one per core")
    ap.add_argument("--busy-cores", type=int, default=0, help="other processes kept spinning meanwhile")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default="tiny",
        help="tiny: init_tiny at --hidden/--layers; qwen2-0.5b: Qwen2-0.5B's shape, random weights",
    )
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--nproc", type=int, default=2, help="processes of the rtrl-ddp and rtrl-fsdp variants")
    ap.add_argument("--only", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--episodes", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.episodes = args.episodes or args.batch * args.steps
    if args.only:
        return child(args)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy_cores)]
    try:
        results = run_variants(args)
    finally:
        for p in spinners:
            p.kill()
    report(args, results)


def run_variants(args) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        shape = {"hidden": args.hidden, "layers": args.layers, "heads": 4, **SHAPES[args.shape]}
        model = init_tiny(Path(tmp) / "model", seed=0, **shape)
        results: dict[str, list[dict]] = {}
        for _ in range(args.repeats):
            for variant in args.variants.split(","):
                cmd = [
                    sys.executable,
                    __file__,
                    "--only",
                    variant,
                    "--model",
                    str(model),
                    *(
                        f"--{k}={getattr(args, k)}"
                        for k in (
                            "hidden",
                            "layers",
                            "prompt",
                            "completion",
                            "batch",
                            "steps",
                            "episodes",
                            "device",
                            "nproc",
                        )
                    ),
                ]
                cmd += [f"--threads={args.threads}"] if args.threads else []
                out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
                if out.returncode:
                    sys.exit(f"{variant} failed:\n{out.stderr[-3000:]}")
                results.setdefault(variant, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def report(args, results: dict[str, list[dict]]) -> None:
    med = {v: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for v, rs in results.items()}
    print(
        f"model: {args.shape} (hidden {args.hidden}, layers {args.layers} when tiny); {args.batch} episodes x "
        f"{args.prompt + args.completion} tokens per step; {args.steps} steps (first excluded); "
        f"device {next(iter(med.values()))['device']}; median of {args.repeats}; "
        f"threads {args.threads or torch.get_num_threads()}; {args.busy_cores} busy core(s)"
    )
    for v, r in med.items():
        runs = ", ".join(f"{x['tokens_per_s']:,.0f}" for x in results[v])
        extra = (
            "" if r["device"] == "cuda" else f" (+{r['peak_mb'] - r['rss_before_mb']:,.0f} MB over the loaded model)"
        )
        print(f"  {v:5s} {r['tokens_per_s']:>9,.0f} tokens/s  peak {r['peak_mb']:,.0f} MB{extra}  (runs: {runs})")
    if "bare" in med and "rtrl" in med:
        print(f"  rtrl / bare = {med['rtrl']['tokens_per_s'] / med['bare']['tokens_per_s']:.3f}")
    if "trl" in med and "rtrl" in med:
        print(f"  rtrl / trl  = {med['rtrl']['tokens_per_s'] / med['trl']['tokens_per_s']:.3f}")


if __name__ == "__main__":
    main()
