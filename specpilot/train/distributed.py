"""Data-parallel drafter training over several processes (one per GPU), launched by torchrun:

    python3 -m torch.distributed.run --standalone --nproc_per_node 2 -m specpilot.cli train-drafter ...

Why: regeneration and the frozen target's forward dominate a training step, and both split cleanly by sequence.
Each rank holds the target and a copy of the drafter, regenerates its shard of the prompts (`--regen-shard` k/N,
set from the rank), takes its own batch of every step (global batch index step * N + rank), and averages the
gradients with one all-reduce per step, so the copies stay equal (checked at the end). Rank 0 alone validates,
writes checkpoints and the run's files, and decides when to stop (deadline, fitted step count): it broadcasts that
decision every step, so the ranks can never disagree about the step count.

Without torchrun's environment (WORLD_SIZE unset or 1) everything here is a no-op and training is unchanged.
"""

from __future__ import annotations

import os

import torch

__all__ = ["Dist", "from_env"]


class Dist:
    """The process group of one training run (world 1: a single process, nothing to do)."""

    def __init__(self, rank: int = 0, world: int = 1, device: torch.device | None = None):
        self.rank, self.world = rank, world
        self.device = device if device is not None else torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td

            td.barrier()

    def share(self, values: list[float]) -> list[float]:
        """Rank 0's `values` on every rank (a broadcast)."""
        if self.world == 1:
            return list(values)
        import torch.distributed as td

        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        td.broadcast(t, src=0)
        return t.tolist()

    def broadcast_params(self, module: torch.nn.Module) -> None:
        """Rank 0's parameters and buffers everywhere (identical starting drafters whatever the init did)."""
        if self.world == 1:
            return
        import torch.distributed as td

        for t in list(module.parameters()) + list(module.buffers()):
            td.broadcast(t.data, src=0)

    def average_grads(self, params) -> None:
        """Mean gradient over the ranks, one flat all-reduce (a parameter with no gradient counts as zero)."""
        if self.world == 1:
            return
        import torch.distributed as td
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        params = [p for p in params if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        td.all_reduce(flat)
        flat /= self.world
        for g, new in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(new)

    def check_in_sync(self, module: torch.nn.Module) -> None:
        """Raise if the ranks' copies of `module` differ (they must not: same start, same averaged steps)."""
        if self.world == 1:
            return
        import torch.distributed as td

        total = torch.stack([p.detach().double().sum() for p in module.parameters()]).sum().view(1)
        lo, hi = total.clone(), total.clone()
        td.all_reduce(lo, op=td.ReduceOp.MIN)
        td.all_reduce(hi, op=td.ReduceOp.MAX)
        if not torch.allclose(lo, hi, rtol=1e-6, atol=0.0):  # float noise is ~1e-12 here; divergence is not
            raise RuntimeError(f"data-parallel ranks diverged: parameter sums {lo.item()} .. {hi.item()}")

    def close(self, ok: bool = True) -> None:
        """Leave together after a finished run (a rank tearing its group down while rank 0 still validates and
        saves aborts the run); after an error, leave at once (the other ranks may never reach a barrier)."""
        if self.world > 1:
            import torch.distributed as td

            if td.is_initialized():
                if ok:
                    td.barrier()
                if ok and not self.main:  # gloo's teardown on a worker rank at the end of a run sometimes aborts
                    import sys  # the process (std::terminate, seen in CI): nothing is left to do, so leave now

                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(0)
                td.destroy_process_group()


def from_env(device: str) -> Dist:
    """A Dist from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); NCCL on CUDA, gloo on CPU. On CUDA each
    rank takes GPU LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Dist(0, 1, torch.device(device))
    import torch.distributed as td

    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
    from datetime import timedelta

    td.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                          timeout=timedelta(minutes=10))  # a rank waits at most this long for the others
    return Dist(rank, world, dev)
