"""GPU-resident CIFAR: the whole split lives on each GPU, batches are cut there.

Why: the conventional input pipeline (PIL image -> ToTensor -> Normalize, one sample at a time in
Python) feeds a process several times fewer samples a second than one GPU trains LeNet or
ResNet-18 on CIFAR at (benchmarks/NOTES.md). CIFAR is 150 MB as uint8 (600 MB as normalized
float32), a sliver of a datacenter GPU, so each process keeps its normalized split on its device
and a batch becomes one gather kernel.

The batches are the torchvision path's (``data.LoaderTrainData``), bit for bit, so a result
never depends on which path ran:
- order: both read ``ShardPlan.indices`` (DistributedSampler's permutation, global-sample resume
  positions, whole steps only), cut into micro-batches in order;
- values: ``x.float() / 255`` then ``(x - mean) / std`` in float32, the same element-wise
  operations as ``data.CifarTensors``, done once at load time;
- augmentation: the same draws of (seed, epoch, sample index) (``crop_draws``), made for the
  whole epoch at once on the GPU; the pixel moves run batched there too, as one gather.

Both paths read the files with ``data.read_arrays`` (CIFAR's pickled batches through a restricted
unpickler, decoded once into a .npy cache by ``array_cache``), not through torchvision's dataset
classes, so a run never imports torchvision to read data (seconds of start-up, benchmarks/NOTES.md);
tests/test_gpu_data.py checks this reader gives torchvision's arrays.

An image folder decoded once (gpu_folder.py) is served by the same classes, with its own image
size, crop padding and normalisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hpc_ddp import ShardPlan, eval_indices
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train import crop_draws
from hpc_ddp.train.cifar.data import (
    MEAN,
    PAD,
    SIZE,
    STD,
    CifarTensors,
    LoaderTrainData,
    load_cifar_arrays,
    load_datasets,
    read_arrays,
)
from hpc_ddp.train.config import DATA_PATHS, TrainConfig
from hpc_ddp.train.data_source import TrainData
from hpc_ddp.train.loader_data import LoaderEvalData


def _as_dataset(split: Split, *, augment: bool, seed: int) -> CifarTensors:
    return CifarTensors(split.images, split.targets, augment=augment, seed=seed)


@dataclass
class Split:
    """One split as read from the files, before a data path is chosen: what ``choose`` uses of
    a ``data.CifarTensors`` (uint8 NCHW ``images``, int64 ``targets``, ``len``), no torchvision."""

    images: torch.Tensor
    targets: torch.Tensor

    def __len__(self) -> int:
        return len(self.targets)


def load_splits(
    cfg: TrainConfig, root: str | Path, device: torch.device
) -> tuple[CifarTensors | Split, CifarTensors | Split, int]:
    """The trainer's read: (train, test, num_classes).

    Where the loader path will run for sure (``data_path=torchvision``, or a device that is not a
    GPU), the splits come as ``data.CifarTensors``; otherwise as ``Split``, which ``choose`` wraps
    in the same way if it falls back to the loader. Both hold the arrays ``data.read_arrays``
    read.
    """
    if cfg.data_path == "torchvision" or not fits_on_device(0, device)[0]:
        return load_datasets(cfg, Path(root))
    (train, test), classes = read_arrays(cfg.dataset, root)
    return Split(*train), Split(*test), classes


def normalize(
    images_u8: torch.Tensor, mean: Sequence[float] = MEAN, std: Sequence[float] = STD
) -> torch.Tensor:
    """ToTensor + Normalize with the torchvision path's float32 operations (bit-identical).

    255 is divided as a device tensor, not a Python number: for a host scalar, CUDA's division
    multiplies by the reciprocal instead, one ulp off the CPU's true division.
    """
    x = images_u8.to(torch.float32).div(torch.tensor(255.0, device=images_u8.device))
    m = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return (x - m) / s


def augment_params(indices: torch.Tensor, *, seed: int, epoch: int, pad: int = PAD) -> torch.Tensor:
    """(len, 3) int64 of (dx, dy, flip) per sample, drawn as the loader path's dataset draws
    them for a crop padded by ``pad`` (CIFAR's 4, an image folder's ``image_folder.pad_of``),
    where ``indices`` live."""
    return crop_draws.draws(indices, seed=seed, epoch=epoch, span=2 * pad + 1)


def channels_last(x: torch.Tensor) -> bool:
    """``x`` is laid out NHWC (and not also NCHW, as a tensor with one channel or pixel is)."""
    return x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()


def take(images: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``images[rows]`` in ``images``' memory format (``index_select`` alone gives NCHW)."""
    if channels_last(images):
        return images.permute(0, 2, 3, 1).index_select(0, rows).permute(0, 3, 1, 2)
    return images.index_select(0, rows)


def crop_flip(
    x: torch.Tensor, params: torch.Tensor, fill: torch.Tensor, pad: int = PAD
) -> torch.Tensor:
    """Batched RandomCrop(H x W, padding=pad) + horizontal flip of normalized (B, C, H, W)
    images (CIFAR's 32 px with 4), in ``x``'s memory format.

    One gather: each output pixel reads its source pixel, or ``fill`` (the normalized value of
    the zero padding) where the source lies in the padding.
    """
    height, width = x.shape[2], x.shape[3]
    dx, dy, flip = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    ar_h = torch.arange(height, device=x.device).view(1, -1)
    ar_w = torch.arange(width, device=x.device).view(1, -1)
    rows = dy - pad + ar_h
    cols = dx - pad + torch.where(flip.bool(), width - 1 - ar_w, ar_w)
    inside_r = (rows >= 0) & (rows < height)
    valid = inside_r.unsqueeze(2) & ((cols >= 0) & (cols < width)).unsqueeze(1)
    b = torch.arange(x.shape[0], device=x.device).view(-1, 1, 1)
    r = rows.clamp(0, height - 1).unsqueeze(2)
    c = cols.clamp(0, width - 1).unsqueeze(1)
    pixels = x.permute(0, 2, 3, 1)[b, r, c]  # (B, H, W, C)
    out = torch.where(valid.unsqueeze(3), pixels, fill.view(1, 1, 1, -1))
    layout = torch.channels_last if channels_last(x) else torch.contiguous_format
    return out.permute(0, 3, 1, 2).contiguous(memory_format=layout)  # NHWC: no copy for that


@dataclass
class GpuTrainData:
    """``TrainData`` over a split held on the device: ``batches(epoch, start)`` like the loader's.

    ``images`` is the normalized float32 split (N, 3, H, W), ``labels`` (N,) int64, both on the
    training device. ``start`` counts global samples already consumed in the epoch. The crop
    pads by ``pad``; ``fill`` is the normalized value of a zero pixel per channel, computed as
    (and where) the loader path normalizes its padding: None for CIFAR's, from ``mean`` and
    ``std`` on the host as ``data.CifarTensors`` does.
    """

    plan: ShardPlan
    images: torch.Tensor
    labels: torch.Tensor
    rank: int = 0
    augment: bool = False
    seed: int = 0
    mean: Sequence[float] = MEAN
    std: Sequence[float] = STD
    pad: int = PAD
    fill: torch.Tensor | None = None
    _fill: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.labels) != self.plan.n:
            raise ValueError(f"plan is for {self.plan.n} samples, data has {len(self.labels)}")
        if self.fill is None:
            m = torch.tensor(self.mean, dtype=torch.float32)
            s = torch.tensor(self.std, dtype=torch.float32)
            self.fill = (0.0 - m) / s
        self._fill = self.fill.to(self.images.device)

    def use_memory_format(self, memory_format: torch.memory_format) -> None:
        """Lay the split out once in the model's memory format: its batches come in it."""
        self.images = self.images.contiguous(memory_format=memory_format)

    def batches(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = self.plan.indices(epoch, self.rank, start).to(self.images.device, non_blocking=True)
        params = None
        if self.augment:  # drawn on the device, queued like the batches: no wait for the host
            params = augment_params(idx, seed=self.seed, epoch=epoch, pad=self.pad)
        step = self.plan.micro_batch
        for lo in range(0, len(idx), step):
            sel = idx[lo : lo + step]
            x = take(self.images, sel)
            if params is not None:
                x = crop_flip(x, params[lo : lo + step], self._fill, self.pad)
            yield x, self.labels.index_select(0, sel)


@dataclass
class GpuEvalData:
    """This rank's exact share of a split on the device (``shard_plan.eval_indices``)."""

    images: torch.Tensor
    labels: torch.Tensor
    rank: int = 0
    world_size: int = 1

    def use_memory_format(self, memory_format: torch.memory_format) -> None:
        """As ``GpuTrainData.use_memory_format``."""
        self.images = self.images.contiguous(memory_format=memory_format)

    def batches(self, batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        shard = eval_indices(len(self.labels), self.rank, self.world_size)
        idx = torch.arange(shard.start, shard.stop, shard.step, device=self.images.device)
        for sel in idx.split(batch_size):
            yield take(self.images, sel), self.labels.index_select(0, sel)


def resident_bytes(n_samples: int, size: int = SIZE) -> int:
    """Device memory a normalized float32 split of RGB ``size`` x ``size`` images and its labels
    take."""
    return n_samples * (3 * size * size * 4 + 8)


def fits_on_device(nbytes: int, device: torch.device, fraction: float = 0.25) -> tuple[bool, str]:
    """Whether ``nbytes`` fit in ``fraction`` of the device's free memory, and why (for the log).

    A quarter leaves the model, activations and NCCL buffers ample room: the GPU path is an
    optimization, so when in doubt the torchvision path runs instead.
    """
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA GPU"
    free, _total = torch.cuda.mem_get_info(device)
    ok = nbytes <= fraction * free
    verb = "fits in" if ok else "exceeds"
    return ok, f"{nbytes / 2**20:.0f} MiB {verb} {fraction:.0%} of {free / 2**30:.1f} GiB free"


def resident(mode: str, nbytes: int, device: torch.device) -> tuple[bool, str]:
    """(whether the data goes to the GPU, why) for ``--data-path mode`` and ``nbytes`` of it
    held there (``fits_on_device``): ``torchvision`` never, ``auto`` where it fits, ``gpu``
    where it fits and otherwise a ConfigError (forced, it is no silent fallback)."""
    if mode not in DATA_PATHS:
        raise ConfigError(f"data_path={mode!r} is not valid", hint=f"use one of {DATA_PATHS}")
    if mode == "torchvision":
        return False, "asked for"
    ok, why = fits_on_device(nbytes, device)
    if mode == "gpu" and not ok:
        raise ConfigError(f"--data-path gpu: {why}", hint="use --data-path auto or torchvision")
    return ok, why


def load_split(
    data_root: str | Path, dataset: str, *, train: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a split and put it, normalized, on ``device``: (images float32, labels int64)."""
    images, labels = load_cifar_arrays(data_root, dataset, train=train)
    x = normalize(torch.from_numpy(images).to(device))
    return x, torch.from_numpy(labels).to(device)


def choose(
    cfg: TrainConfig,
    plan: ShardPlan,
    train_set: CifarTensors | Split,
    test_set: CifarTensors | Split,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    log: Callable[[str], None] | None = None,
) -> tuple[TrainData, GpuEvalData | LoaderEvalData]:
    """The trainer's data: GPU-resident when ``data_path`` asks for it or ``auto`` finds it fits.

    ``gpu`` on a machine where it cannot work is a configuration error, not a silent fallback;
    ``auto`` falls back to torchvision (CPU device, too little free GPU memory, loader workers
    asked for) and says why in the log.
    """
    log = log or get_logger("data").info
    ok, why = resident(cfg.data_path, resident_bytes(len(train_set) + len(test_set)), device)
    if not ok:
        log(f"data: torchvision loader ({why})")
        if isinstance(train_set, Split):  # read by load_splits: the same arrays, wrapped
            train_set = _as_dataset(train_set, augment=cfg.augment, seed=cfg.seed)
        if isinstance(test_set, Split):
            test_set = _as_dataset(test_set, augment=False, seed=cfg.seed)
        loader = LoaderTrainData(plan, train_set, rank, device, cfg.num_workers or 0)
        return loader, LoaderEvalData(test_set, rank, world_size, device)
    log(f"data: GPU-resident ({why})")
    train = GpuTrainData(
        plan=plan,
        images=normalize(train_set.images.to(device)),
        labels=train_set.targets.to(device),
        rank=rank,
        augment=cfg.augment,
        seed=cfg.seed,
    )
    test = GpuEvalData(
        normalize(test_set.images.to(device)), test_set.targets.to(device), rank, world_size
    )
    return train, test
