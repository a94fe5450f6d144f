"""Data order: one global permutation per epoch, sharded across ranks, resumable mid-epoch, on
the same or on another number of ranks.

The permutation is ``torch.randperm(n)`` with a generator seeded ``seed + epoch``, as
DistributedSampler does, so every data path (torchvision loader, GPU-resident tensors) that calls
these functions sees the identical order, sharded as DistributedSampler(drop_last=False) shards it
(gpu_data.GpuTrainData cuts its batches from ShardPlan.indices too; tests/test_gpu_data.py checks).
Positions are counted in GLOBAL samples: after k micro-batches of size b on each of W ranks,
``k * b * W`` samples of the epoch are consumed (padding included). Dealt round-robin, those are
exactly the first ``k * b * W`` samples of the permutation, whatever W is: so the rest of the
epoch after ``start`` is ``perm[start:]``, dealt round-robin over the ranks there are now
(:func:`remainder_indices`). On the same W that is DistributedSampler's shard without its first
``start / W`` samples; on another W' every sample of the epoch is still trained on once.

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
    return remainder_indices(perm, 0, rank, world_size, drop_last=drop_last)


def remainder_indices(
    perm: torch.Tensor, start: int, rank: int, world_size: int, *, drop_last: bool = False
) -> torch.Tensor:
    """This rank's share of what is left of an epoch after ``start`` global samples, on
    ``world_size`` ranks (which need not be the world that consumed those samples).

    The rest, ``perm[start:]``, is dealt round-robin. Ranks must take equal shares, so a rest
    that is not a multiple of ``world_size`` is padded with the permutation's head (fewer than
    ``world_size`` samples, trained on twice in that epoch, as DistributedSampler pads), or with
    drop_last=True its tail is dropped. ``start`` at or past ``len(perm)`` (the padding of the
    world that stopped there included) leaves nothing. With ``start`` a multiple of
    ``world_size`` (a resume on the same world) this is DistributedSampler's shard without its
    first ``start / world_size`` samples, bit for bit.
    """
    import torch

    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    if start < 0:
        raise ValueError(f"start={start}: a position in the epoch is a sample count >= 0")
    n = len(perm)
    rest = perm[start:]
    left = len(rest)
    if drop_last:
        rest = rest[: left - left % world_size]
    elif left % world_size:
        pad = world_size - left % world_size
        rest = torch.cat([rest, perm.repeat(pad // n + 1)[:pad]])
    return rest[rank::world_size]


def eval_indices(n: int, rank: int, world_size: int) -> range:
    """Exact evaluation shard: ``range(rank, n, world_size)``; the shards partition range(n)."""
    return range(rank, n, world_size)


@dataclass(frozen=True)
class ShardPlan:
    """How one epoch of n samples is cut into micro-batches and optimizer steps.

    Each rank takes its padded DistributedSampler shard and cuts it into micro-batches of
    ``micro_batch`` (the last one short, as a DataLoader with drop_last=False); a step is
    ``accum_steps`` micro-batches (the epoch's last step may have fewer). ``start`` counts GLOBAL
    samples consumed in the epoch. On this plan's world it is a step boundary; after a resume on
    another world size it is wherever that world stopped (any count >= 0), and the rest of the
    epoch (:func:`remainder_indices`) is cut into steps from there: ``steps_done(start)`` counts
    the steps such an epoch has behind it as the steps it lacks to its end.
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

    def rank_left(self, start: int) -> int:
        """Samples each rank has left in an epoch after ``start`` global samples."""
        if start < 0:
            raise ValueError(f"start={start}: a position in the epoch is a sample count >= 0")
        return -(-max(self.n - start, 0) // self.world_size)

    def steps_done(self, start: int) -> int:
        """Steps of the epoch behind ``start``: those it lacks, ``ceil(rank_left / step)``, taken
        from the epoch's steps (on this plan's world, the steps taken to reach ``start``)."""
        return self.steps_per_epoch() - -(-self.rank_left(start) // self.rank_step_samples)

    def step_start(self, steps_done: int, origin: int = 0) -> int:
        """Global samples consumed after ``steps_done`` steps of an epoch entered at ``origin``
        (0, or where a resume began it: steps_done counts from ``steps_done(origin)`` there)."""
        taken = (steps_done - self.steps_done(origin)) * self.rank_step_samples
        return origin + min(taken, self.rank_left(origin)) * self.world_size

    def indices(self, epoch: int, rank: int, start: int = 0) -> torch.Tensor:
        """This rank's indices for the rest of the epoch after ``start`` global samples."""
        perm = epoch_permutation(self.n, self.seed, epoch)
        return remainder_indices(perm, start, rank, self.world_size)
