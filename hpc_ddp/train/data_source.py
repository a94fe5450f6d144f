"""What a dataset entry of the registry gives the trainer: ``Splits``.

A dataset builder (``registry``: ``f(cfg, ctx, comm) -> Splits``) reads both splits on every
rank; the trainer then sizes its ``ShardPlan`` from ``n`` and asks ``make`` for the batches of
this rank, once the model says on which device its input goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from hpc_ddp import ShardPlan

Batch = tuple[torch.Tensor, torch.Tensor]


class TrainData(Protocol):
    """This rank's training micro-batches of an epoch, from sample ``start`` of it on."""

    def batches(self, epoch: int, start: int) -> Iterator[Batch]: ...


class EvalData(Protocol):
    """This rank's exact share of the test split (the shards partition it: no padding)."""

    def batches(self, batch_size: int) -> Iterator[Batch]: ...


class Splits(Protocol):
    n: int  # training samples
    num_classes: int

    def make(
        self, plan: ShardPlan, *, rank: int, world_size: int, device: torch.device
    ) -> tuple[TrainData, EvalData]: ...

    def example(self) -> torch.Tensor:
        """One training input with a batch dimension of 1, as the model gets it (the layout
        probe of ``hpc_ddp.speed_up``)."""
        ...
