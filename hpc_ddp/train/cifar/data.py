"""CIFAR-10/100: staging, reading, sharding, augmentation.

The files are CIFAR's python-format pickles. torchvision's dataset classes read them with plain
``pickle.load``, which would run any code a file in a shared, writable ``--data-dir`` names, so this
module reads them itself through ``cifar_pickle``'s restricted unpickler (the arrays come out
identical, tests/test_gpu_data.py checks). torchvision is imported only to download (its classes
check the official MD5 sums before they unpickle anything): importing it costs seconds of start-up
(``torchvision.datasets`` pulls in ``torchvision.models`` and ``torch._dynamo``;
benchmarks/NOTES.md).

Staging (download or synthetic write) runs once per node *and* per filesystem: on each node only
local rank 0 stages, under a file lock in the data dir (so nodes sharing a filesystem take turns
and the second finds the data present), then every rank waits at a barrier.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from filelock import FileLock, Timeout
from torch.utils.data import Dataset

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.log import get_logger
from hpc_ddp.private_paths import replace_file
from hpc_ddp.regular_file import open_regular, read_small
from hpc_ddp.train import crop_draws, loader_data
from hpc_ddp.train.cifar import safe_pickle, synthetic
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast import array_cache
from hpc_ddp.train.loader_data import eval_batches  # noqa: F401  (the CIFAR tests' name)

if TYPE_CHECKING:
    from torchvision.datasets import CIFAR10

log = get_logger("data")

# CIFAR-10's training-set statistics, the values the conventional scripts use for both sets.
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)
PAD = 4  # RandomCrop(32, padding=4)
DOWNLOAD_TIMEOUT_S = 60.0
# Staging is serialised by a file lock in the data dir; its holder writes who it is beside it.
# One holder's download of CIFAR-100 (161 MB) or check of a staged copy ends well inside
# STAGING_WAIT_S, and each new holder (node after node on a shared dir) gets a full wait of its
# own; one that was stopped (Ctrl-Z, `scontrol suspend`) or hangs never lets go, and every
# later run would wait without a word.
STAGING_LOCK, STAGING_HOLDER = ".hpc-ddp-staging.lock", ".hpc-ddp-staging.holder"
STAGING_POLL_S, STAGING_NOTICE_S, STAGING_WAIT_S = 1.0, 10.0, 600.0
# The official files' MD5 sums, as torchvision's CIFAR10/CIFAR100 classes list them (a test checks
# they still match), so a staged copy is verified without importing torchvision.
OFFICIAL_MD5 = {
    "cifar10": {
        "data_batch_1": "c99cafc152244af753f735de768cd75f",
        "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
        "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
        "data_batch_4": "634d18415352ddfa80567beed471001a",
        "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
        "test_batch": "40351d587109b95175f43aff81a1287e",
        "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
    },
    "cifar100": {
        "train": "16019d7e3df5f24257cddd939b257f8d",
        "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
        "meta": "7973b15100ade9c7d40fb424638fde48",
    },
}


class DataError(HpcDdpError):
    """The dataset is missing, corrupt or cannot be downloaded."""


def dataset_class(name: str, *, is_synthetic: bool) -> type[CIFAR10]:
    """torchvision's class; for synthetic data a subclass that skips the official MD5 sums."""
    from torchvision.datasets import CIFAR10, CIFAR100  # lazily: see the module docstring

    base = CIFAR10 if name == "cifar10" else CIFAR100
    if not is_synthetic:
        return base
    attrs = {
        "train_list": [[f, None] for f, _ in base.train_list],
        "test_list": [[f, None] for f, _ in base.test_list],
        "meta": {**base.meta, "md5": None},
    }
    return type(f"Synthetic{base.__name__}", (base,), attrs)


def _md5(path: Path) -> str | None:
    digest = hashlib.md5(usedforsecurity=False)
    try:  # a regular file only: a FIFO or device in its place would block or never end
        with open_regular(path, follow_symlinks=True) as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    except OSError:
        return None
    return digest.hexdigest()


def _present(dataset: str, root: Path) -> bool:
    """The official files are all there with their MD5 sums (what torchvision checks)."""
    folder = root / synthetic.FOLDERS[dataset]
    return all(_md5(folder / name) == md5 for name, md5 in OFFICIAL_MD5[dataset].items())


def data_root(cfg: TrainConfig) -> Path:
    data_dir = Path(cfg.data_dir)
    if cfg.synthetic:
        size = (cfg.synthetic_train_size, cfg.synthetic_test_size)
        return synthetic.synthetic_root(data_dir, cfg.dataset, *size, cfg.synthetic_variant)
    return data_dir


def stage(cfg: TrainConfig) -> Path:
    """Make the dataset present under ``data_root(cfg)``; call on local rank 0 only."""
    data_dir = Path(cfg.data_dir)
    if cfg.synthetic and not data_dir.is_dir():
        # We write every file of it ourselves: created (said, not silent), a typo costs nothing.
        # A real dataset's missing folder stays an error below: a typo there would hide a copy.
        data_dir.mkdir(parents=True, exist_ok=True)
        print(f"created data dir {data_dir} for the synthetic {cfg.dataset}", flush=True)
    if not data_dir.is_dir():
        raise ConfigError(
            f"data dir {data_dir} does not exist",
            hint="create it (the dataset is downloaded into it), or point --data-dir at the "
            f"directory that contains {synthetic.FOLDERS[cfg.dataset]}/",
        )
    root = data_root(cfg)
    with _staging_lock(data_dir):
        if cfg.synthetic:
            size = {"train_size": cfg.synthetic_train_size, "test_size": cfg.synthetic_test_size}
            kind = {**size, "variant": cfg.synthetic_variant}
            if not synthetic.is_current(root, cfg.dataset, seed=1234, **kind):
                log.info(f"writing synthetic {cfg.dataset} ({kind}) to {root}")
                synthetic.write_synthetic(root, cfg.dataset, **kind)
        elif not _present(cfg.dataset, root):
            cls = dataset_class(cfg.dataset, is_synthetic=False)  # names for the message
            if not cfg.download:
                raise DataError(
                    f"{cls.__name__} not found (or corrupt) in {root}/{cls.base_folder}",
                    hint="pass --download, or point --data-dir at a staged copy "
                    "(the directory holding the unpacked archive)",
                )
            _download(cls, root)
    return root


@contextlib.contextmanager
def _staging_lock(data_dir: Path) -> Iterator[None]:
    """The data dir's staging lock. The wait says why after STAGING_NOTICE_S and ends in a
    DataError naming the holder once one holder has kept it STAGING_WAIT_S."""
    lock = FileLock(str(data_dir / STAGING_LOCK))
    holder_file = data_dir / STAGING_HOLDER
    started = time.monotonic()
    holder, since, told = _staging_holder(holder_file), started, False
    while True:
        try:
            lock.acquire(timeout=STAGING_POLL_S)
            break
        except Timeout:
            now, current = time.monotonic(), _staging_holder(holder_file)
            if current != holder:  # the lock changed hands: a new holder's own full wait
                holder, since = current, now
            who = current or "another process"
            if not told and now - started >= STAGING_NOTICE_S:
                log.info(f"waiting for {lock.lock_file}: {who} is staging data in {data_dir}")
                told = True
            if now - since >= STAGING_WAIT_S:
                raise DataError(
                    f"{lock.lock_file} has been held by {who} for {STAGING_WAIT_S:.0f} s",
                    hint="a stopped or hung run holds it (on that host, `fuser -v "
                    f"{lock.lock_file}` names it): end it, or use another --data-dir",
                ) from None
    try:
        with contextlib.suppress(OSError):  # only a courtesy to those who wait
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            me = f"pid {os.getpid()} on {socket.gethostname()} since {stamp}"
            replace_file(holder_file, me.encode())
        yield
    finally:
        lock.release()


def _staging_holder(path: Path) -> str | None:
    """Who holds the staging lock, as its holder wrote it (printable characters only)."""
    try:
        text = read_small(path, 200).decode(errors="replace")
    except OSError:
        return None
    return "".join(c for c in text if c.isprintable()) or None


def _download(cls: type[CIFAR10], root: Path) -> None:
    log.info(f"downloading {cls.url} into {root}")
    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_TIMEOUT_S)  # urllib would otherwise wait forever
    try:
        cls(str(root), train=True, download=True)
    except Exception as err:
        raise DataError(
            f"could not download {cls.__name__} from {cls.url}: {type(err).__name__}: {err}",
            hint="this machine cannot reach the internet (compute nodes often cannot): download "
            f"{cls.filename} elsewhere, unpack it into a directory so that it holds "
            f"{cls.base_folder}/, and pass --data-dir DIR (or use --synthetic)",
        ) from None
    finally:
        socket.setdefaulttimeout(old)


class CifarTensors(Dataset):
    """Images as normalised float tensors, augmented with draws of (seed, epoch, sample index).

    The draws (``crop_draws``) depend neither on loader workers, nor on the global RNG, nor on
    where an epoch resumed; gpu_data.py makes the same draws batched on the GPU, so both data
    paths give bit-identical batches. The loader
    hands it ``EpochIndex`` indices that carry their epoch (persistent workers never see an
    epoch set on their copy of the dataset).
    """

    epoch_indices = True

    def __init__(
        self, images: torch.Tensor, targets: torch.Tensor, *, augment: bool, seed: int
    ) -> None:
        self.images = images.contiguous()  # uint8 NCHW
        self.targets = targets.to(torch.int64)
        self.augment = augment
        self.seed = seed
        self.epoch = 0  # set before each epoch's iterator starts (workers copy the dataset then)
        self.mean = torch.tensor(MEAN, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(STD, dtype=torch.float32).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.images[index].to(torch.float32).div(255)
        if self.augment:  # RandomCrop(32, padding=4) + RandomHorizontalFlip
            epoch = getattr(index, "epoch", self.epoch)
            dx, dy, flip = crop_draws.draw(index, seed=self.seed, epoch=epoch, span=2 * PAD + 1)
            x = F.pad(x, (PAD, PAD, PAD, PAD))[:, dy : dy + SIZE, dx : dx + SIZE]
            if flip:
                x = x.flip(2)
        return (x - self.mean) / self.std, self.targets[int(index)]


class LoaderTrainData(loader_data.LoaderTrainData):
    """The generic loader path over ``CifarTensors``, whose augmentation is seeded per epoch."""

    data: CifarTensors

    def batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.data.epoch = epoch
        return super().batches(epoch, start)


# On-disk layout of the "python version" archives, as torchvision reads them.
CIFAR_FILES = {
    "cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]),
    "cifar100": ("cifar-100-python", ["train"], ["test"]),
}
# The class names: (meta file, key), as torchvision's ``_load_meta`` reads them.
CLASS_NAMES = {"cifar10": ("batches.meta", "label_names"), "cifar100": ("meta", "fine_label_names")}
SIZE = 32


def load_cifar_arrays(
    data_root: str | Path, dataset: str, *, train: bool
) -> tuple[np.ndarray, np.ndarray]:
    """One split from CIFAR's pickled on-disk format: (N, 3, 32, 32) uint8 and (N,) int64."""
    if dataset not in CIFAR_FILES:
        raise ValueError(f"dataset {dataset!r} is not one of {', '.join(CIFAR_FILES)}")
    folder, train_files, test_files = CIFAR_FILES[dataset]
    images, labels = [], []
    for name in train_files if train else test_files:
        pixels, targets = array_cache.read_batch(
            Path(data_root) / folder / name, safe_pickle.LABEL_KEYS
        )
        images.append(pixels.reshape(-1, 3, SIZE, SIZE))
        labels.append(targets)
    return np.concatenate(images), np.concatenate(labels)


def load_class_names(data_root: str | Path, dataset: str) -> list[str]:
    """The class names from the split's meta file (``len`` is torchvision's ``len(classes)``)."""
    name, key = CLASS_NAMES[dataset]
    path = Path(data_root) / CIFAR_FILES[dataset][0] / name
    names = safe_pickle.load(path).get(key)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise safe_pickle.NotCifarFileError(f"{path} is not CIFAR's meta file: no {key!r} list")
    return names


Arrays = tuple[torch.Tensor, torch.Tensor]


def read_arrays(dataset: str, root: str | Path) -> tuple[tuple[Arrays, Arrays], int]:
    """((train images, labels), (test images, labels)), num_classes: uint8 NCHW, int64."""
    try:
        splits = [load_cifar_arrays(root, dataset, train=t) for t in (True, False)]
        classes = load_class_names(root, dataset)
    except (OSError, pickle.UnpicklingError, ValueError) as err:
        raise DataError(
            f"cannot read {dataset} from {root}: {type(err).__name__}: {err}",
            hint=f"point --data-dir at the directory holding {CIFAR_FILES[dataset][0]}/",
        ) from None
    train, test = ((torch.from_numpy(x), torch.from_numpy(y)) for x, y in splits)
    return (train, test), len(classes)


def load_datasets(cfg: TrainConfig, root: Path) -> tuple[CifarTensors, CifarTensors, int]:
    """(train, test, num_classes) for the DataLoader path."""
    (train, test), num_classes = read_arrays(cfg.dataset, root)
    return (
        CifarTensors(*train, augment=cfg.augment, seed=cfg.seed),
        CifarTensors(*test, augment=False, seed=cfg.seed),
        num_classes,
    )


def prepare(
    cfg: TrainConfig, *, local_rank: int, check: Callable[[BaseException | None, str], None]
) -> Path:
    """Stage on local rank 0, then all ranks agree (``check`` is a collective) before reading."""
    error: BaseException | None = None
    if local_rank == 0:
        try:
            stage(cfg)
        except Exception as err:  # any failure must reach the other ranks, not strand them
            error = err
    check(error, "staging the dataset")
    return data_root(cfg)
