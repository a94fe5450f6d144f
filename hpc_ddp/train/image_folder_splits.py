"""The trainer's data of an image folder (``--dataset imagefolder``): the registry's builder,
``load``, and what it gives the trainer, ``ImageFolderSplits``.

Apart from image_folder.py (the files, the dataset, the decode) because it asks the fast path
where the data lives (fast/gpu_folder.py, which builds on that dataset): decoded once and held
on the GPU, or streamed from the files by the loader's workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hpc_ddp import Comm, ShardPlan
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train import loader_settings
from hpc_ddp.train.data_source import EvalData, TrainData
from hpc_ddp.train.fast import gpu_folder
from hpc_ddp.train.image_folder import (
    ImageFolderDataset,
    Normalised,
    folder_hint,
    read_splits,
    stage_synthetic,
    synthetic_folder,
)
from hpc_ddp.train.loader_data import LoaderEvalData, LoaderTrainData

if TYPE_CHECKING:
    from hpc_ddp.dist import DistContext
    from hpc_ddp.train.config import TrainConfig

log = get_logger("data")


@dataclass
class ImageFolderSplits:
    """The trainer's data (``data_source.Splits``) of an image folder: streamed from the files,
    or ``resident`` on the GPU, decoded once (fast/gpu_folder.py)."""

    train_set: ImageFolderDataset
    test_set: ImageFolderDataset
    settings: loader_settings.LoaderSettings
    resident: gpu_folder.DecodedFolder | None = None

    @property
    def n(self) -> int:
        return len(self.train_set)

    @property
    def num_classes(self) -> int:
        return len(self.train_set.classes)

    def make(
        self, plan: ShardPlan, *, rank: int, world_size: int, device: torch.device
    ) -> tuple[TrainData, EvalData]:
        if self.resident is not None:
            return self.resident.serve(plan, rank=rank, world_size=world_size, device=device)
        train = LoaderTrainData(plan, self.train_set, rank, device, settings=self.settings)
        test = LoaderEvalData(self.test_set, rank, world_size, device, settings=self.settings)
        return Normalised(train), Normalised(test)

    def example(self) -> torch.Tensor:
        return self.train_set.item(0)[0].unsqueeze(0).float()


def load(cfg: TrainConfig, ctx: DistContext, comm: Comm) -> ImageFolderSplits:
    """The registry's builder of ``imagefolder``: stage the synthetic folder (local rank 0, if
    asked), then every rank scans both splits; a failure on one rank fails them all. Then the
    fast path's answer to where the data lives (``--data-path``): decoded once and held on the
    GPU, or streamed from the files by the loader's workers."""
    error: BaseException | None = None
    if cfg.synthetic and ctx.env.local_rank == 0:
        try:
            stage_synthetic(cfg)
        except Exception as err:
            error = err
    comm.check(error, "staging the synthetic image folder")
    root = synthetic_folder(cfg) if cfg.synthetic else Path(cfg.data_dir)
    splits: tuple[ImageFolderDataset, ImageFolderDataset] | None = None
    try:
        if not root.is_dir():
            raise ConfigError(f"data dir {root} does not exist", hint=folder_hint())
        splits = read_splits(cfg, root)
    except Exception as err:
        error = err
    comm.check(error, f"reading the image folder {root}")
    assert splits is not None
    settings = loader_settings.choose(
        cfg.num_workers,
        from_disk=True,
        cuda=ctx.devices[0].type == "cuda",
        source=ctx.env.source,
        local_world_size=ctx.env.local_world_size,
    )
    train, test = splits
    log.info(
        f"data: image folder {root}: {len(train)} training and {len(test)} test images of "
        f"{len(train.classes)} classes at {train.size} px, decoded by "
        f"{'torchvision.io' if train.torchvision else 'Pillow'} in the loader's workers"
    )
    resident = gpu_folder.decode_if_held(
        cfg.data_path, train, test, settings, device=ctx.devices[0], comm=comm, log=log.info
    )
    if resident is None:
        log.info(settings.describe())
    return ImageFolderSplits(train, test, settings, resident)
