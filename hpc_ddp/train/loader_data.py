"""A map-style dataset served through a DataLoader over this rank's ``ShardPlan`` indices.

The data path of any dataset that is not held on the GPU: the CIFAR demo's torchvision path
(cifar/data.py adds its per-epoch augmentation seed) and every plug-in dataset.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset

from hpc_ddp.runtime.sampler import ResumableDistributedSampler
from hpc_ddp.runtime.shard_plan import ShardPlan, eval_indices
from hpc_ddp.train.data_source import Batch


@dataclass
class LoaderTrainData:
    """Training micro-batches from a DataLoader over this rank's ``ShardPlan`` indices."""

    plan: ShardPlan
    data: Dataset[Any]
    rank: int
    device: torch.device
    num_workers: int = 0

    def batches(self, epoch: int, start: int) -> Iterator[Batch]:
        sampler = ResumableDistributedSampler(self.plan, self.rank)
        sampler.set_epoch(epoch, start)
        loader = DataLoader(
            self.data,
            batch_size=self.plan.micro_batch,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
        )
        for x, y in loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def eval_batches(
    data: Dataset[Any], rank: int, world_size: int, batch_size: int, device: torch.device
) -> Iterator[Batch]:
    """This rank's exact share of the test set (no padding: the shards partition the set)."""
    shard = Subset(data, list(eval_indices(len(data), rank, world_size)))  # type: ignore[arg-type]
    for x, y in DataLoader(shard, batch_size=batch_size, shuffle=False):
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


@dataclass
class LoaderEvalData:
    """The evaluation shard behind the ``batches(size)`` interface of ``data_source.EvalData``."""

    dataset: Dataset[Any]
    rank: int
    world_size: int
    device: torch.device

    def batches(self, batch_size: int) -> Iterator[Batch]:
        return eval_batches(self.dataset, self.rank, self.world_size, batch_size, self.device)
