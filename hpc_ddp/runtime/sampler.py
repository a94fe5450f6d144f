"""Data order: one global permutation per epoch, sharded across ranks, resumable mid-epoch.

The permutation is ``torch.randperm(n)`` with a generator seeded ``seed + epoch``, as
DistributedSampler does, so every data path (torchvision loader, GPU-resident tensors) that calls
these functions sees the identical order, sharded as DistributedSampler(drop_last=False) shards it
(gpu_data.GpuTrainData cuts its batches from ShardPlan.indices too; tests/test_gpu_data.py checks).
Positions are counted in GLOBAL samples: after k micro-batches of size b on each of W ranks,
``k * b * W`` samples of the epoch are consumed (padding included).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

# Re-exported: the plan's arithmetic lives in shard_plan.py (torch-free); code written against
# this module's names keeps working.
from hpc_ddp.runtime.shard_plan import ShardPlan, eval_indices

__all__ = [
    "ResumableDistributedSampler",
    "ShardPlan",
    "epoch_permutation",
    "eval_indices",
    "rank_indices",
]


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's global order of sample indices (int64 tensor of length n)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g)


def rank_indices(
    perm: torch.Tensor, rank: int, world_size: int, *, drop_last: bool = False
) -> torch.Tensor:
    """This rank's share of an epoch's permutation, exactly as DistributedSampler computes it.

    drop_last=False (the default, used for training) pads by repeating the permutation's head
    so every rank gets ``ceil(n / world_size)`` samples; drop_last=True drops the tail instead.
    Exact evaluation uses ``eval_indices``: no padding, no dropping.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    n = len(perm)
    if drop_last:
        perm = perm[: n - n % world_size]
    elif n % world_size:
        pad = world_size - n % world_size
        perm = torch.cat([perm, perm.repeat(pad // n + 1)[:pad]])
    return perm[rank::world_size]


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """A Sampler over ``ShardPlan.indices``: call ``set_epoch(epoch, start)`` before iterating."""

    def __init__(self, plan: ShardPlan, rank: int) -> None:
        self.plan = plan
        self.rank = rank
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def __iter__(self) -> Iterator[int]:
        return iter(self.plan.indices(self.epoch, self.rank, self.start).tolist())

    def __len__(self) -> int:
        return self.plan.per_rank - self.start // self.plan.world_size
