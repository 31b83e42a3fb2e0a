"""Where this process stands among the data-parallel replicas of a training run.

One process: `Replicas()` (rank 0 of 1), and nothing here does anything. Under
`torch.distributed.run` (train/distributed.py), every rank holds the whole run's episodes and
plan; an optimizer step covers `grad_accum x world` micro-batches and rank r trains micro-batches
r, r + world, ... of them, so the global batch is the same whatever the number of processes.

`sharded` (train.strategy "fsdp"): the base model's weights are split over the ranks, so every
forward pass is a collective (each layer's weights are gathered) -- every rank runs the same
number of micro-batches in a step (a rank with fewer adds zero-weight stand-ins) -- and the
LoRA weights, kept whole on every rank, have their gradients averaged here once per step
(DistributedDataParallel does it itself under "ddp").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Replicas:
    rank: int = 0
    world: int = 1
    sharded: bool = False

    @property
    def main(self) -> bool:
        """The rank that logs, checkpoints and saves."""
        return self.rank == 0

    def mine(self, step_micro: list[list[int]]) -> tuple[list[list[int]], int]:
        """This rank's micro-batches of a step, and how many of the last of them are stand-ins
        (run with zero weight): a last step with fewer micro-batches than ranks still needs every
        rank in the gradient all-reduce, so a rank without one runs the step's first; sharded,
        every rank runs as many as the rank with the most."""
        own = step_micro[self.rank :: self.world]
        need = -(-len(step_micro) // self.world) if self.sharded else 1
        pad = max(need - len(own), 0)
        return own + step_micro[:1] * pad, pad

    def average_gradients(self, params: list[Any]) -> None:
        """Sharded: the whole (LoRA) weights' gradients averaged over the ranks, once per step."""
        if not self.sharded or self.world == 1:
            return
        import torch
        import torch.distributed as dist

        for p in params:
            if p.grad is None:  # (every rank ran a backward pass; kept symmetric all the same)
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
            p.grad /= self.world

    def merge(self, sums: dict[str, float], tokens: int) -> tuple[dict[str, float], int]:
        """The step's metric sums over every rank (min/max for the log-ratio extremes)."""
        if self.world == 1:
            return sums, tokens
        import torch.distributed as dist

        gathered: list[tuple[dict[str, float], int]] = [({}, 0)] * self.world
        dist.all_gather_object(gathered, (sums, tokens))
        out: dict[str, float] = {}
        for part, _ in gathered:
            for key, value in part.items():
                if key not in out:
                    out[key] = value
                elif key.endswith("_min"):
                    out[key] = min(out[key], value)
                elif key.endswith("_max"):
                    out[key] = max(out[key], value)
                else:
                    out[key] += value
        return out, sum(t for _, t in gathered)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()
