"""Data order: one global permutation per epoch, sharded across ranks, resumable mid-epoch.

The permutation is ``torch.randperm(n)`` with a generator seeded ``seed + epoch``, as
DistributedSampler does, so every data path (torchvision loader, GPU-resident tensors) that calls
these functions sees the identical order, sharded as DistributedSampler(drop_last=False) shards it
(gpu_data.GpuTrainData cuts its batches from ShardPlan.indices too; tests/test_gpu_data.py checks).
Positions are counted in GLOBAL samples: after k micro-batches of size b on each of W ranks,
``k * b * W`` samples of the epoch are consumed (padding included).

Torch is imported only where an order is computed, so that the plan's arithmetic (steps per
epoch, resumable positions, evaluation shards) serves a login node and ``import hpc_ddp`` without
it. The torch ``Sampler`` over a plan is ``sampler.ResumableDistributedSampler``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's global order of sample indices (int64 tensor of length n)."""
    import torch

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
    import torch

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    n = len(perm)
    if drop_last:
        perm = perm[: n - n % world_size]
    elif n % world_size:
        pad = world_size - n % world_size
        perm = torch.cat([perm, perm.repeat(pad // n + 1)[:pad]])
    return perm[rank::world_size]


def eval_indices(n: int, rank: int, world_size: int) -> range:
    """Exact evaluation shard: ``range(rank, n, world_size)``; the shards partition range(n)."""
    return range(rank, n, world_size)


@dataclass(frozen=True)
class ShardPlan:
    """How one epoch of n samples is cut into micro-batches and optimizer steps.

    Each rank takes its padded DistributedSampler shard and cuts it into micro-batches of
    ``micro_batch`` (the last one short, as a DataLoader with drop_last=False); a step is
    ``accum_steps`` micro-batches (the epoch's last step may have fewer). ``start`` counts GLOBAL
    samples consumed in the epoch, i.e. ``world_size`` times this rank's position, and must be a
    step boundary; a different world size pads and shards differently, so resuming mid-epoch
    needs the same world size (the trainer refuses otherwise).
    """

    n: int
    seed: int
    world_size: int
    micro_batch: int
    accum_steps: int = 1

    @property
    def per_rank(self) -> int:
        return -(-self.n // self.world_size)

    @property
    def rank_step_samples(self) -> int:
        return self.micro_batch * self.accum_steps

    def steps_per_epoch(self) -> int:
        return -(-self.per_rank // self.rank_step_samples)

    def step_start(self, steps_done: int) -> int:
        """Global samples consumed after ``steps_done`` steps of an epoch."""
        return min(steps_done * self.rank_step_samples, self.per_rank) * self.world_size

    def steps_done(self, start: int) -> int:
        """Steps of the epoch behind ``start``; raises if ``start`` is not a step boundary."""
        pos, rem = divmod(start, self.world_size)
        if rem or pos > self.per_rank or (pos % self.rank_step_samples and pos != self.per_rank):
            raise ValueError(f"start={start} is not a step boundary of {self}")
        return -(-pos // self.rank_step_samples)

    def indices(self, epoch: int, rank: int, start: int = 0) -> torch.Tensor:
        """This rank's indices for the rest of the epoch after ``start`` global samples."""
        self.steps_done(start)  # validates
        shard = rank_indices(epoch_permutation(self.n, self.seed, epoch), rank, self.world_size)
        return shard[start // self.world_size :]
