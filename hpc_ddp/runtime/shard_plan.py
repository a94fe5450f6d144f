"""How an epoch is cut across ranks, as arithmetic: torch-free, so that a login node can size
and check a run's steps (and ``import hpc_ddp`` stays light) without loading torch.

The order of the samples themselves (a torch permutation) lives in ``runtime/sampler.py``;
``ShardPlan.indices`` loads it on first use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


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
        """This rank's indices for the rest of the epoch after ``start`` global samples (torch)."""
        from hpc_ddp.runtime.sampler import epoch_permutation, rank_indices

        self.steps_done(start)  # validates
        shard = rank_indices(epoch_permutation(self.n, self.seed, epoch), rank, self.world_size)
        return shard[start // self.world_size :]
