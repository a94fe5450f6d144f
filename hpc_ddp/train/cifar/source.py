"""The CIFAR datasets as a registry entry: stage (download or synthesize), read, choose a path."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hpc_ddp import Comm, ShardPlan
from hpc_ddp.log import get_logger
from hpc_ddp.train.cifar import data
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.data_source import EvalData, TrainData
from hpc_ddp.train.fast import gpu_data

if TYPE_CHECKING:
    from hpc_ddp import DistContext


@dataclass
class CifarSplits:
    cfg: TrainConfig
    train_set: data.CifarTensors | gpu_data.Split
    test_set: data.CifarTensors | gpu_data.Split
    num_classes: int

    @property
    def n(self) -> int:
        return len(self.train_set)

    def make(
        self, plan: ShardPlan, *, rank: int, world_size: int, device: torch.device
    ) -> tuple[TrainData, EvalData]:
        return gpu_data.choose(
            self.cfg,
            plan,
            self.train_set,
            self.test_set,
            rank=rank,
            world_size=world_size,
            device=device,
            log=get_logger().info,
        )

    def example(self) -> torch.Tensor:
        return self.train_set.images[:1].float()


def load(cfg: TrainConfig, ctx: DistContext, comm: Comm) -> CifarSplits:
    """Stage on each node's local rank 0, agree, read (torchvision's classes only where its
    loader will run: the GPU path reads the files itself)."""
    root = data.prepare(cfg, local_rank=ctx.env.local_rank, check=comm.check)
    train_set, test_set, num_classes = gpu_data.load_splits(cfg, root, ctx.devices[0])
    return CifarSplits(cfg, train_set, test_set, num_classes)
