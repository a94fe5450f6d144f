"""The torch ``Sampler`` over a ``ShardPlan``: a DataLoader's resumable, DistributedSampler-
ordered shard. The order and the plan themselves are shard_plan.py's (torch-free to import).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from hpc_ddp.runtime.shard_plan import ShardPlan


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """A Sampler over ``ShardPlan.indices``: call ``set_epoch(epoch, start)`` before iterating;
    ``start`` (global samples consumed) may come from a run on another number of ranks."""

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
        return self.plan.rank_left(self.start)
