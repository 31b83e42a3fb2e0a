"""Peak memory of the gate's comparison (`PolicySet.compare`: both policies' log-probs and the
KL between them on the held-out episodes) as the number of episodes grows, on a model with a
real-sized vocabulary.

    .venv/bin/python benchmarks/gate_memory.py                        # 50 and 500 episodes, 32k BPE
    .venv/bin/python benchmarks/gate_memory.py --episodes 50 400 --vocab 151936 --completion 100

The model: `init_tiny --tokenizer bpe` (Qwen2 architecture, width 64: the vocabulary is what
costs memory here), a random LoRA adapter as the candidate, the base as the champion. Episodes:
chat prompts and `--completion` served token ids drawn from the vocabulary. Each episode count
runs in its own process; the figure is how far the process's peak RSS rose during `compare`
above its RSS before it (the model and the episodes already loaded).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one(model_dir: Path, n: int, completion: int) -> dict:
    import torch

    from pipeline.core.config import TrainConfig
    from pipeline.core.types import LoggedEpisode
    from train.inference import PolicySet
    from train.lora import attach_adapter, save_adapter
    from train.models import load_policy

    torch.set_num_threads(2)
    adapter = model_dir.parent / "adapter"
    if not adapter.exists():
        policy = load_policy(model_dir, device="cpu")
        torch.manual_seed(1)
        peft_model = attach_adapter(policy.model, TrainConfig(lora_r=8, lora_alpha=16))
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.05)
        save_adapter(peft_model, adapter)
    policies = PolicySet.load(model_dir, device="cpu")
    policies.add("cand", adapter)
    rng = random.Random(0)
    vocab = len(policies.tokenizer)
    specials = set(policies.tokenizer.all_special_ids)
    episodes = []
    for i in range(n):
        ids = [t for t in (rng.randrange(vocab) for _ in range(completion * 2)) if t not in specials][:completion]
        prompt = [{"role": "user", "content": f"task {i}: " + " ".join(rng.choice("abcdefgh") for _ in range(20))}]
        episodes.append(LoggedEpisode(f"r{i}", prompt, policies.tokenizer.decode(ids), ids, None, 1.0))
    before = _rss_mb()
    t0 = time.perf_counter()
    p, q, kl = policies.compare(None, "cand", episodes)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert sum(x is not None for x in p) == n, "every episode compared"
    return {
        "episodes": n,
        "vocab": vocab,
        "completion_tokens": completion,
        "rss_before_mb": round(before),
        "peak_rss_mb": round(peak),
        "compare_rise_mb": round(peak - before),
        "seconds": round(seconds, 1),
        "kl": kl,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--episodes", type=int, nargs="+", default=[50, 500])
    ap.add_argument("--vocab", type=int, default=32_768)
    ap.add_argument("--completion", type=int, default=100, help="served tokens per episode")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.model, args.one, args.completion)))
        return
    from train.models import init_tiny

    with tempfile.TemporaryDirectory() as tmp:
        model = init_tiny(Path(tmp) / "model", arch="qwen2", tokenizer="bpe", vocab=args.vocab)
        for n in args.episodes:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    str(n),
                    "--model",
                    str(model),
                    "--completion",
                    str(args.completion),
                ],
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                print(out.stderr[-3000:], file=sys.stderr)
                raise SystemExit(out.returncode)
            print(out.stdout.strip().splitlines()[-1], flush=True)


if __name__ == "__main__":
    main()
