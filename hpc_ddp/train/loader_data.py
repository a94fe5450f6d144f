"""A map-style dataset served through a DataLoader over this rank's ``ShardPlan`` indices.

The data path of any dataset that is not held on the GPU: the CIFAR demo's torchvision path
(cifar/data.py adds its per-epoch augmentation seed) and every plug-in dataset.

A dataset whose item cannot be read returns a ``FailedItem`` in its place instead of raising.
The DataLoader carries it, as the batch, to the process that iterates, which raises its error
there: an exception raised in a worker process would reach the user as that worker's traceback
inside a new exception's message, and one that ends a worker (SystemExit) as "worker exited
unexpectedly", neither naming the dataset nor the item.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Subset, default_collate

from hpc_ddp import ResumableDistributedSampler, ShardPlan, eval_indices
from hpc_ddp.errors import ConfigError
from hpc_ddp.train.data_source import Batch


@dataclass(frozen=True)
class FailedItem:
    """An item a dataset could not give: the error to raise where the batches are used."""

    message: str
    hint: str | None = None

    def error(self) -> ConfigError:
        return ConfigError(self.message, hint=self.hint)


def collate(items: list[Any]) -> Any:
    """``default_collate``, or the first ``FailedItem`` among ``items`` as the batch."""
    failed = next((item for item in items if isinstance(item, FailedItem)), None)
    return failed if failed is not None else default_collate(items)


def _on(device: torch.device, batches: Iterable[Any]) -> Iterator[Batch]:
    for batch in batches:
        if isinstance(batch, FailedItem):
            raise batch.error()
        x, y = batch
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


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
            collate_fn=collate,
            pin_memory=self.device.type == "cuda",
        )
        return _on(self.device, loader)


def eval_batches(
    data: Dataset[Any], rank: int, world_size: int, batch_size: int, device: torch.device
) -> Iterator[Batch]:
    """This rank's exact share of the test set (no padding: the shards partition the set)."""
    shard = Subset(data, list(eval_indices(len(data), rank, world_size)))  # type: ignore[arg-type]
    return _on(device, DataLoader(shard, batch_size=batch_size, shuffle=False, collate_fn=collate))


@dataclass
class LoaderEvalData:
    """The evaluation shard behind the ``batches(size)`` interface of ``data_source.EvalData``."""

    dataset: Dataset[Any]
    rank: int
    world_size: int
    device: torch.device

    def batches(self, batch_size: int) -> Iterator[Batch]:
        return eval_batches(self.dataset, self.rank, self.world_size, batch_size, self.device)
