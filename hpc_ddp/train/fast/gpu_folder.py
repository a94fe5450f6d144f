"""An image folder decoded once and held on the GPU (``--dataset imagefolder``, ``--data-path``).

Why: the streamed path (image_folder.py) decodes every image every epoch in DataLoader workers,
and for a small folder (64 px: 50,000 images are 614 MB as uint8) a node's cores decode slower
than its GPUs train, while the decoded splits fit in a sliver of a GPU's memory. Decoded once,
the folder is served as CIFAR's GPU-resident split is (gpu_data.py): a batch is one gather
kernel, the crop and flip run batched on the GPU from the same draws.

- When: ``--data-path auto`` where the normalised float32 splits fit ``gpu_data.fits_on_device``
  on every rank (they agree: each rank's decode is a share of one collective); ``gpu`` forces
  it (a ConfigError on every rank where it cannot be); ``torchvision`` streams.
- Decoding: each rank decodes every world-th image of each split (index = rank mod world), as
  uint8, in the workers ``loader_settings`` chose; an all_gather on the process group (NCCL on
  GPUs, Gloo on CPU) of the shares, padded to one length, gives every rank the whole split. A
  file that does not decode is one error naming it on every rank (``FailedItem``, then
  ``Comm.check`` before the gather, so that no rank waits in it for one that raised).
- The batches are the streamed path's, bit for bit, for the same (seed, epoch, start): the
  images normalised by ``image_folder.normalise`` on the device where the streamed path
  normalises its batches, the crop padded by ``image_folder.pad_of``, the padding's value that
  of a normalised zero pixel, computed there too.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from hpc_ddp import Comm, ShardPlan
from hpc_ddp.train.fast import gpu_data
from hpc_ddp.train.fast.gpu_data import GpuEvalData, GpuTrainData
from hpc_ddp.train.image_folder import ImageFolderDataset, normalise, pad_of
from hpc_ddp.train.loader_data import FailedItem, collate
from hpc_ddp.train.loader_settings import LoaderSettings

# What a worker decodes and hands over at a time: up to 256 images, and at most 16 MiB of them,
# so that the batches in flight (workers x prefetch) stay within a GiB at any image size, while
# a batch of small images is enough work to outweigh its hand-over.
DECODE_BATCH = 256
DECODE_BATCH_BYTES = 16 << 20


def decode_batch(size: int) -> int:
    """Images per decoding batch at ``size`` px (RGB uint8): 1 to DECODE_BATCH."""
    return min(max(DECODE_BATCH_BYTES // (3 * size * size), 1), DECODE_BATCH)


@dataclass
class DecodedFolder:
    """Both splits, normalised float32 on the device, with their labels."""

    train: torch.Tensor
    train_labels: torch.Tensor
    test: torch.Tensor
    test_labels: torch.Tensor
    fill: torch.Tensor  # a zero pixel, normalised on the device: the crop's padding
    pad: int
    augment: bool
    seed: int

    def serve(
        self, plan: ShardPlan, *, rank: int, world_size: int, device: torch.device
    ) -> tuple[GpuTrainData, GpuEvalData]:
        """This rank's data over the resident splits (``data_source.Splits.make``)."""
        train = GpuTrainData(
            plan=plan,
            images=self.train.to(device),
            labels=self.train_labels.to(device),
            rank=rank,
            augment=self.augment,
            seed=self.seed,
            pad=self.pad,
            fill=self.fill,
        )
        test = GpuEvalData(self.test.to(device), self.test_labels.to(device), rank, world_size)
        return train, test


def decide(
    mode: str, n_images: int, size: int, device: torch.device, comm: Comm
) -> tuple[bool, str]:
    """(hold the folder on the GPU, why), the same on every rank: ``gpu_data.resident`` of the
    decoded splits' bytes, held only where every rank's GPU has room, and ``gpu`` that cannot
    be one error on every rank."""
    ok, why, error = False, "", None
    try:
        ok, why = gpu_data.resident(mode, gpu_data.resident_bytes(n_images, size), device)
    except Exception as err:  # ConfigError: --data-path gpu where it cannot be
        error = err
    comm.check(error, "choosing where the image folder is held")
    everywhere = comm.sum([float(ok)])[0] == comm.world_size
    if ok and not everywhere:
        return False, f"{why} here, but not on every rank"
    return ok, why


def decode_share(
    dataset: ImageFolderDataset, rank: int, world: int, settings: LoaderSettings
) -> torch.Tensor:
    """Images ``rank``, ``rank + world``, ... of ``dataset`` as one uint8 tensor, decoded
    without augmentation or normalisation by ``settings``' workers (one-off: not persistent,
    not pinned). Raises the error of the first file that does not decode."""
    plain = copy.copy(dataset)  # not dataclasses.replace: that would scan the folder again
    plain.augment, plain.normalise = False, False
    indices = list(range(rank, len(dataset), world))
    out = torch.empty(len(indices), 3, dataset.size, dataset.size, dtype=torch.uint8)
    kwargs = settings.loader_kwargs()
    kwargs["pin_memory"] = False
    if settings.workers:
        kwargs["persistent_workers"] = False
    # Its own generator: an iterator otherwise draws its workers' seed from the global RNG.
    kwargs["generator"] = torch.Generator().manual_seed(0)
    loader = DataLoader(
        Subset(plain, indices), batch_size=decode_batch(dataset.size), collate_fn=collate, **kwargs
    )
    at = 0
    for batch in loader:
        if isinstance(batch, FailedItem):
            raise batch.error()
        images, _labels = batch
        out[at : at + len(images)] = images
        at += len(images)
    return out


def interleave(stacked: torch.Tensor, n: int) -> torch.Tensor:
    """The split from the ranks' shares stacked as (world, per, ...), share ``r`` holding
    images r, r + world, ...: image ``i`` is ``stacked[i % world, i // world]``."""
    world, per = stacked.shape[0], stacked.shape[1]
    return stacked.transpose(0, 1).reshape(world * per, *stacked.shape[2:])[:n]


def gather(share: torch.Tensor, n: int, comm: Comm) -> torch.Tensor:
    """The whole split of ``n`` images on ``comm.device`` from every rank's ``share``."""
    world = comm.world_size
    per = -(-n // world)  # the longest share: the others are padded to it
    padded = torch.zeros(per, *share.shape[1:], dtype=share.dtype, device=comm.device)
    padded[: len(share)] = share.to(comm.device)
    if not comm.active:
        return padded[:n]
    # The shares concatenated along the first dimension (the form both NCCL and Gloo take).
    shares = torch.empty(world * per, *share.shape[1:], dtype=padded.dtype, device=comm.device)
    dist.all_gather_into_tensor(shares, padded)
    return interleave(shares.view(world, *padded.shape), n)


def labels(dataset: ImageFolderDataset) -> torch.Tensor:
    return torch.tensor([label for _, label in dataset.samples], dtype=torch.int64)


def decode_if_held(
    mode: str,
    train_set: ImageFolderDataset,
    test_set: ImageFolderDataset,
    settings: LoaderSettings,
    *,
    device: torch.device,
    comm: Comm,
    log: Callable[[str], None],
) -> DecodedFolder | None:
    """Both splits decoded once and held on ``device`` where ``decide`` says so (one line in
    the log either way), else None: the streamed path serves them."""
    ok, why = decide(mode, len(train_set) + len(test_set), train_set.size, device, comm)
    if not ok:
        log(f"data: streamed from the files by the loader's workers ({why})")
        return None
    start = time.perf_counter()
    shares: list[torch.Tensor] = []
    error: BaseException | None = None
    try:
        shares = [
            decode_share(s, comm.rank, comm.world_size, settings) for s in (train_set, test_set)
        ]
    except Exception as err:
        error = err
    comm.check(error, "decoding the image folder")
    seconds = time.perf_counter() - start  # the slowest rank's: the check waited for it
    train, test = (
        normalise(gather(share, len(s), comm).to(device))
        for share, s in zip(shares, (train_set, test_set), strict=True)
    )
    zero = torch.zeros(1, 3, 1, 1, dtype=torch.uint8, device=device)
    n = settings.workers
    by = f"{n} worker{'s' if n > 1 else ''} a process" if n else "the training process"
    log(f"data: image folder decoded once in {seconds:.1f} s by {by}; GPU-resident ({why})")
    return DecodedFolder(
        train=train,
        train_labels=labels(train_set).to(device),
        test=test,
        test_labels=labels(test_set).to(device),
        fill=normalise(zero).view(3),
        pad=pad_of(train_set.size),
        augment=train_set.augment,
        seed=train_set.seed,
    )
