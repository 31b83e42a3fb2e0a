"""Where this process stands among the data-parallel replicas of a training run.

One process: `Replicas()` (rank 0 of 1), and nothing here does anything. Under
`torch.distributed.run` (train/distributed.py), every rank holds the whole run's episodes and
plan; an optimizer step covers `grad_accum x world` micro-batches and rank r trains micro-batches
r, r + world, ... of them, so the global batch is the same whatever the number of processes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Replicas:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """The rank that logs, checkpoints and saves."""
        return self.rank == 0

    def mine(self, step_micro: list[list[int]]) -> tuple[list[list[int]], bool]:
        """This rank's micro-batches of a step, and whether they are a stand-in: a last step
        with fewer micro-batches than ranks still needs every rank in the gradient all-reduce,
        so a rank without one runs the step's first with zero weight."""
        own = step_micro[self.rank::self.world]
        return (own, False) if own else (step_micro[:1], True)

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
