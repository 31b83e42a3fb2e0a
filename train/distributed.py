"""Data-parallel training in `train.nproc` processes, launched with torch.distributed.run (the
elastic launcher behind torchrun): NCCL between GPUs, gloo on CPUs.

    parent   run_training (train/run.py) with train.nproc = N > 1, after selection and tokenization:
               job.pt      the tokenized episodes, rewards, groups, the config, the base model, and
                           the adapter to start from (the champion's, or a fresh one saved here, so
                           every rank starts from the same weights)
               launch      python -m torch.distributed.run --standalone --nproc-per-node N
                           --max-restarts 0 -m train.distributed <job dir>
               read back   the adapter rank 0 saved, the loop's result, its metrics (replayed into
                           the run's tracker, which lives in the parent)
    rank r   init_process_group, the base model and the start adapter on its device, wrapped in
             DistributedDataParallel (train.strategy "ddp") or sharded with FSDP2 ("fsdp":
             shard_base); train_policy(replicas=Replicas(r, N)): every rank holds every
             episode, a step is grad_accum x N micro-batches and rank r trains every N-th one
             (train/replicas.py); the gradients are averaged once per step

Failure: a rank that dies takes the others down (the launcher stops the group and exits non-zero,
`--max-restarts 0`): DistributedTrainingError with the exit code and the tail of every rank's
log, and the run fails as any failed run (the cycle retries it). A rank that hangs in a
collective is stopped after `train.ddp_timeout_s` (the process group's timeout), never waited
on forever; the parent also kills the launcher once that time has passed without a step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from pipeline.core.config import TrainConfig
from train.data import TokenizedEpisode
from train.loop import LoopResult, plan_microbatches, train_policy
from train.replicas import Replicas
from train.tracking import MemoryTracker, Tracker


class DistributedTrainingError(RuntimeError):
    """The ranks did not finish; the message has the launcher's exit code and the ranks' last lines."""


def run_distributed(
    job_dir: Path,
    base_model: Path,
    start_adapter: Path,
    episodes: list[TokenizedEpisode],
    rewards: list[float],
    groups: list[str],
    cfg: TrainConfig,
    tracker: Tracker,
    checkpoint_dir: Path | None = None,
    resume_from: Path | None = None,
    on_step: Callable[[int, int, dict[str, float]], None] | None = None,
) -> tuple[LoopResult, Path]:
    """Train in cfg.nproc processes; returns the loop's result and the trained adapter's directory."""
    job_dir.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "episodes": [vars(e) for e in episodes],
            "rewards": rewards,
            "groups": groups,
            "cfg": cfg.model_dump(mode="json"),
            "base_model": str(base_model),
            "start": str(start_adapter),
            "checkpoint_dir": str(checkpoint_dir) if checkpoint_dir else None,
            "resume_from": str(resume_from) if resume_from else None,
        },
        job_dir / "job.pt",
    )
    for stale in ("result.json", "metrics.jsonl"):
        (job_dir / stale).unlink(missing_ok=True)
    logs = job_dir / "logs"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.nproc}",
        "--max-restarts=0",
        "--log-dir",
        str(logs),
        "--redirects",
        "3",
        "-m",
        "train.distributed",
        str(job_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(cfg.cpu_threads or max(1, (os.cpu_count() or 1) // cfg.nproc))}
    launcher_log = job_dir / "launcher.log"  # a file, not a pipe: nobody reads a pipe while the ranks run
    with launcher_log.open("w") as out:
        launcher = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    total = math.ceil(
        len(plan_microbatches([len(e.input_ids) for e in episodes], cfg, cfg.nproc)) / (cfg.grad_accum * cfg.nproc)
    )
    metrics_file, seen, last_progress = job_dir / "metrics.jsonl", 0, time.monotonic()
    while launcher.poll() is None:
        time.sleep(0.2)  # polling the ranks' progress file, with a deadline below
        lines = _complete_lines(metrics_file)
        for line in lines[seen:]:
            step, metrics = json.loads(line)
            tracker.log_metrics(metrics, step=step)
            if on_step:
                try:
                    on_step(step, total, metrics)  # e.g. the lease check: raising stops the ranks
                except BaseException:
                    launcher.kill()
                    launcher.wait()
                    raise
            last_progress = time.monotonic()
        seen = len(lines)
        if time.monotonic() - last_progress > cfg.ddp_timeout_s + 60:
            launcher.kill()
    output = launcher_log.read_text(errors="replace")
    if launcher.returncode != 0 or not (job_dir / "result.json").exists():
        raise DistributedTrainingError(
            f"data-parallel training in {cfg.nproc} processes failed (launcher exit code {launcher.returncode}); "
            f"the ranks' last lines:\n{_tail_logs(logs, output)}"
        )
    for line in _complete_lines(metrics_file)[seen:]:
        step, metrics = json.loads(line)
        tracker.log_metrics(metrics, step=step)
    result = LoopResult(**json.loads((job_dir / "result.json").read_text()))
    return result, job_dir / "adapter"


def _complete_lines(path: Path) -> list[str]:
    """The lines rank 0 has finished writing (a line being written has no newline yet)."""
    text = path.read_text() if path.exists() else ""
    return text[: text.rfind("\n") + 1].splitlines()


def _tail_logs(logs: Path, launcher_output: str, lines: int = 15) -> str:
    parts = []
    for path in sorted(logs.rglob("*.log")) if logs.exists() else []:
        text = path.read_text(errors="replace").strip().splitlines()[-lines:]
        if text:
            parts.append(f"[{path.parent.name}/{path.name}]\n" + "\n".join(text))
    parts.append("[launcher]\n" + "\n".join(launcher_output.strip().splitlines()[-lines:]))
    return "\n".join(parts)


class _FileTracker(MemoryTracker):
    """Rank 0's metrics, one JSON line per step, for the parent to replay into the real tracker."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps([step, metrics]) + "\n")


def shard_base(model: Any, device_type: str, world: int) -> Any:
    """FSDP2 over the ranks: each decoder layer's frozen weights (and the rest of the base model's)
    split into `world` shards, gathered layer by layer for a forward or backward pass; the LoRA
    weights are left out of the sharding (small, and the only ones trained): whole on every
    rank, their gradients averaged by Replicas.average_gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (world,))
    trained = {p for p in model.parameters() if p.requires_grad}
    for module in model.modules():
        if type(module).__name__.endswith("DecoderLayer"):
            fully_shard(module, mesh=mesh, ignored_params={p for p in module.parameters() if p in trained})
    fully_shard(model, mesh=mesh, ignored_params=trained)
    return model


def _held(model: Any) -> dict[str, int]:
    """Parameters this rank holds (a shard's elements under FSDP) against the model's, both frozen
    and trained: what sharding saves, for the run's record and the tests."""
    out = {"frozen_held": 0, "frozen_total": 0, "trained": 0}
    for p in model.parameters():
        if p.requires_grad:
            out["trained"] += p.numel()
        else:
            local = p.to_local() if hasattr(p, "to_local") else p  # a DTensor's shard
            out["frozen_held"] += local.numel()
            out["frozen_total"] += p.numel()
    return out


def worker(job_dir: Path) -> None:
    """One rank: what torch.distributed.run starts with RANK, WORLD_SIZE, LOCAL_RANK set."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from train.lora import load_adapter, save_adapter, set_gradient_checkpointing
    from train.models import load_policy

    job = torch.load(job_dir / "job.pt", weights_only=False)
    cfg = TrainConfig.model_validate(job["cfg"])
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.ddp_timeout_s))
    try:
        policy = load_policy(job["base_model"], device=device)
        model = load_adapter(policy.model, job["start"], trainable=True)
        set_gradient_checkpointing(model, cfg.gradient_checkpointing)
        if cfg.strategy == "fsdp":
            wrapped = shard_base(model, "cuda" if cuda else "cpu", world)
        else:
            # no buffer broadcast: a LoRA model's buffers never change, and ranks may run different
            # numbers of forward passes in a step (a last step shorter than grad_accum x N)
            wrapped = DistributedDataParallel(model, device_ids=[local] if cuda else None, broadcast_buffers=False)
        episodes = [TokenizedEpisode(**e) for e in job["episodes"]]
        tracker: Tracker = _FileTracker(job_dir / "metrics.jsonl") if rank == 0 else MemoryTracker()
        result = train_policy(
            wrapped,
            episodes,
            job["rewards"],
            job["groups"],
            cfg,
            tracker,
            policy.tokenizer.pad_token_id,
            checkpoint_dir=Path(job["checkpoint_dir"]) if job["checkpoint_dir"] else None,
            resume_from=Path(job["resume_from"]) if job["resume_from"] else None,
            replicas=Replicas(rank, world, sharded=cfg.strategy == "fsdp"),
        )
        if rank == 0:
            save_adapter(model, job_dir / "adapter")
            (job_dir / "memory.json").write_text(json.dumps(_held(model)))
            (job_dir / "result.json").write_text(
                json.dumps(
                    {
                        "steps": result.steps,
                        "tokens": result.tokens,
                        "seconds": result.seconds,
                        "advantages": result.advantages,
                        "history": result.history,
                    }
                )
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
