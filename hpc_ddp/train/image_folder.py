"""Image folders from disk: ``--dataset imagefolder --data-dir DIR``, DIR holding ``train/`` and
``test/`` (or ``val/``), each a folder per class of PNG or JPEG files (torchvision's
``ImageFolder`` shape). ``ImageFolderDataset`` is also public for a plug-in dataset
(``--dataset my_data:split`` returning one), where it gives normalised float tensors.

Where the decoded splits fit on the GPU (``--data-path auto``, or ``gpu``), the folder is decoded
once, each rank a share, and held there (fast/gpu_folder.py, which image_folder_splits.py asks):
no worker runs after that. Otherwise it is streamed; where each part of that pipeline runs, and
why there:

- Decoding, in the DataLoader's worker processes (loader_settings.py chooses how many from the
  cores): it is the expensive part (a millisecond or more per 224 px image), and it scales with
  cores, not with the GPU. torchvision.io decodes when it is installed (several times faster
  than Pillow's decode and copy to an array), else Pillow. The header is read first either way
  (a PNG's by its fixed layout, any other file's by Pillow), to refuse a file that is not
  PNG/JPEG or claims more pixels than MAX_PIXELS before anything is allocated.
- Random crop (pad 1/8 of the side, as 4 px of CIFAR's 32) and horizontal flip, in the worker,
  on the decoded uint8 image: one copy of a window of bytes the decode just wrote (cache-hot),
  negligible beside the decode; done on the GPU it would need a per-sample launch or a batched
  gather of its own, and the image travels as bytes either way.
- Normalisation, on the GPU: the batch crosses PCIe as uint8 (a quarter of float32's bytes,
  from pinned memory) and becomes float there in one elementwise kernel.

Each sample's crop and flip are drawn from (seed, epoch, sample index) (the loader's
``EpochIndex``; ``crop_draws``, the CIFAR paths' draws), never from a worker's RNG: which worker
decodes which sample, and where a resumed epoch starts, change nothing, so a resumed run is
bit-identical.

Every file is someone else's input: a non-image file, a file that does not decode, one larger
than MAX_FILE_BYTES or over MAX_PIXELS, a FIFO or device in a class folder are each an error
naming the file (exit 2), found by the scan (names and types) or when the item is read.
"""

from __future__ import annotations

import functools
import io
import os
import stat
import struct
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.log import get_logger
from hpc_ddp.regular_file import open_regular, read_whole
from hpc_ddp.train import crop_draws, image_synthetic, loader_settings
from hpc_ddp.train.data_source import Batch
from hpc_ddp.train.loader_data import FailedItem

if TYPE_CHECKING:
    from hpc_ddp.train.config import TrainConfig

log = get_logger("data")

EXTENSIONS = (".png", ".jpg", ".jpeg")
FORMATS = ("PNG", "JPEG")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# A training image of a few hundred pixels per side is at most a few MiB encoded; the bounds only
# stop a planted file from making a worker read or allocate without end.
MAX_FILE_BYTES = 64 << 20
MAX_PIXELS = 8192 * 8192
MAX_CLASSES = 1 << 20
MAX_SAMPLES = 1 << 31
MAX_SIDE = 1024  # --image-size
# ImageNet's per-channel statistics, what image-folder training usually normalises with.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
TEST_SPLITS = ("test", "val")
SYNTHETIC_CLASSES = 10
SYNTHETIC_SIZE = 64


class ImageFolderError(HpcDdpError):
    """An image folder, or one of its files, is not what the trainer can read."""


def folder_hint() -> str:
    return (
        "an image folder holds train/ and test/ (or val/), each with one folder per class of "
        f"{', '.join(EXTENSIONS)} files and nothing else"
    )


def scan(split_dir: Path) -> tuple[list[str], list[tuple[str, int]]]:
    """(class names, (file, label) per sample) of one split folder, in sorted order.

    Only names and types are checked here (one ``stat`` per entry); contents when read."""
    try:
        entries = sorted(os.scandir(split_dir), key=lambda e: e.name)
    except OSError as err:
        raise ImageFolderError(
            f"cannot list {split_dir}: {err.strerror}", hint=folder_hint()
        ) from None
    classes = []
    for entry in entries:
        if not entry.is_dir():  # follows a symlink to a folder
            raise ImageFolderError(
                f"{entry.path} is not a folder: {split_dir} holds one folder per class",
                hint=folder_hint(),
            )
        classes.append(entry.name)
    if not 1 <= len(classes) <= MAX_CLASSES:
        raise ImageFolderError(
            f"{split_dir} has {len(classes)} class folders (1 to {MAX_CLASSES})", hint=folder_hint()
        )
    samples: list[tuple[str, int]] = []
    for label, name in enumerate(classes):
        for entry in sorted(os.scandir(Path(split_dir) / name), key=lambda e: e.name):
            _check_entry(entry)
            samples.append((entry.path, label))
            if len(samples) > MAX_SAMPLES:
                raise ImageFolderError(f"{split_dir} has more than {MAX_SAMPLES} images")
    if not samples:
        raise ImageFolderError(f"{split_dir} has no images", hint=folder_hint())
    return classes, samples


def _check_entry(entry: os.DirEntry[str]) -> None:
    if not entry.name.lower().endswith(EXTENSIONS):
        raise ImageFolderError(
            f"{entry.path} is not an image file (by its name)", hint=folder_hint()
        )
    try:
        mode = entry.stat().st_mode  # follows a symlink: links to shared copies are common
    except OSError as err:
        raise ImageFolderError(
            f"cannot read {entry.path}: {err.strerror}", hint=folder_hint()
        ) from None
    if not stat.S_ISREG(mode):
        raise ImageFolderError(f"{entry.path} is not a regular file", hint=folder_hint())


def _decoder() -> Any:
    """torchvision.io when it is installed (first called in the process that forks the workers,
    so they inherit the import), else None: Pillow decodes."""
    try:
        with warnings.catch_warnings():  # its notice that TorchCodec will take over decoding
            warnings.simplefilter("ignore", DeprecationWarning)
            import torchvision.io as tvio
    except Exception:  # not installed, or broken: Pillow is always there with it
        return None
    return tvio if hasattr(tvio, "decode_image") else None


@dataclass
class ImageFolderDataset(Dataset[tuple[torch.Tensor, int] | FailedItem]):
    """One split of an image folder: ``(image, label)`` with ``image`` a 3 x size x size tensor.

    ``normalise=True`` (the default, for a plug-in): float32, normalised with MEAN and STD.
    ``False`` (the built-in dataset): uint8, normalised on the GPU (``Normalised``).
    ``size`` 0: every image must have the first image's size; else each is resized to it.
    A file that cannot be read gives a ``FailedItem`` naming it (the loader raises it)."""

    root: Path
    augment: bool = False
    seed: int = 0
    size: int = 0
    normalise: bool = True
    classes: list[str] = field(default_factory=list, init=False)
    samples: list[tuple[str, int]] = field(default_factory=list, init=False, repr=False)
    # loader_settings / loader_data read these: decoded from files; items depend on the epoch.
    from_disk = True
    epoch_indices = True

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.classes, self.samples = scan(self.root)
        self.torchvision = _decoder() is not None  # a flag: a module does not pickle
        if not self.size:
            self.size = self._first_side()

    def _first_side(self) -> int:
        height, width = _header(self.samples[0][0])
        if height != width:
            raise ImageFolderError(
                f"{self.samples[0][0]} is {width} x {height} px, not square",
                hint="pass --image-size N to resize every image to N x N",
            )
        return height

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int] | FailedItem:
        return FailedItem.or_item(self.item, index)

    def item(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[int(index)]
        x = self.decode(path)
        if self.augment:
            x = self._crop_flip(x, getattr(index, "epoch", 0), int(index))
        if self.normalise:
            x = normalise(x.unsqueeze(0)).squeeze(0)
        return x, label

    def decode(self, path: str) -> torch.Tensor:
        """The file as a 3 x size x size uint8 tensor."""
        try:
            with open_regular(path, follow_symlinks=True) as fh:
                data = read_whole(fh, MAX_FILE_BYTES, path)
        except OSError as err:
            raise ImageFolderError(f"cannot read {path}: {err.strerror or err}") from None
        height, width = _header(path, data)
        if (height, width) == (self.size, self.size) and self.torchvision:
            tvio = _decoder()
            try:
                buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                with warnings.catch_warnings():  # _decoder's notice, given at each call
                    warnings.simplefilter("ignore", DeprecationWarning)
                    return tvio.decode_image(buffer, mode=tvio.ImageReadMode.RGB)
            except RuntimeError as err:
                raise ImageFolderError(
                    f"{path} does not decode: {err}", hint=folder_hint()
                ) from None
        return _pillow(path, data, self.size)

    def _crop_flip(self, x: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        """A random window of the image padded by size/8 with zeros, flipped half the time."""
        pad = pad_of(self.size)
        dx, dy, flip = crop_draws.draw(index, seed=self.seed, epoch=epoch, span=2 * pad + 1)
        x = window(x, dy - pad, dx - pad)
        return x.flip(2) if flip else x


def pad_of(size: int) -> int:
    """The random crop's zero padding of a ``size`` px image: 1/8 of it, as CIFAR's 4 of 32."""
    return max(size // 8, 1)


def window(x: torch.Tensor, top: int, left: int) -> torch.Tensor:
    """The C x H x W window of ``x`` whose corner is at (top, left) of it, zeros outside: the
    crop of a zero-padded copy, without making the padded copy (a worker's cost per image)."""
    _, height, width = x.shape
    y0, y1 = max(top, 0), min(top + height, height)
    x0, x1 = max(left, 0), min(left + width, width)
    out = torch.zeros_like(x)
    out[:, y0 - top : y1 - top, x0 - left : x1 - left] = x[:, y0:y1, x0:x1]
    return out


def _header(path: str, data: bytes | None = None) -> tuple[int, int]:
    """(height, width) from the file's header, refusing what is not a PNG/JPEG or too large."""
    if data is None:
        try:
            with open_regular(path, follow_symlinks=True) as fh:
                data = read_whole(fh, MAX_FILE_BYTES, path)
        except OSError as err:
            raise ImageFolderError(
                f"{path} is not a readable image: {err}", hint=folder_hint()
            ) from None
    width, height = _png_size(data) or _pillow_size(path, data)
    if width * height > MAX_PIXELS or not width or not height:
        raise ImageFolderError(
            f"{path} claims {width} x {height} px (at most {MAX_PIXELS} pixels)", hint=folder_hint()
        )
    return height, width


def _png_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a PNG, from its IHDR chunk (which the format puts first, at a fixed
    offset), else None. Read in place of Pillow's parse, a tenth of a worker's cost per image;
    a PNG broken after its header fails in the decode, naming the file."""
    if len(data) < 24 or data[:8] != PNG_SIGNATURE or data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _pillow_size(path: str, data: bytes) -> tuple[int, int]:
    """(width, height) as Pillow reads the header, refusing a format other than PNG/JPEG."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, size = im.format, im.size
    except UnidentifiedImageError:
        raise ImageFolderError(
            f"{path} is not a readable image: Pillow recognises no image format in it",
            hint=folder_hint(),
        ) from None
    except Image.DecompressionBombError:  # Pillow's own bound, above ours
        raise ImageFolderError(
            f"{path} claims more than {MAX_PIXELS} pixels", hint=folder_hint()
        ) from None
    except (OSError, ValueError) as err:
        raise ImageFolderError(
            f"{path} is not a readable image: {err}", hint=folder_hint()
        ) from None
    if fmt not in FORMATS:
        raise ImageFolderError(f"{path} is a {fmt} image, not PNG or JPEG", hint=folder_hint())
    return size


def _pillow(path: str, data: bytes, size: int) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            rgb = im.convert("RGB")
            if rgb.size != (size, size):
                rgb = rgb.resize((size, size), Image.Resampling.BILINEAR)
            pixels = np.array(rgb, dtype=np.uint8)
    except (OSError, ValueError) as err:
        raise ImageFolderError(f"{path} does not decode: {err}", hint=folder_hint()) from None
    return torch.from_numpy(pixels).permute(2, 0, 1).contiguous()


def normalise(x: torch.Tensor) -> torch.Tensor:
    """uint8 N x 3 x H x W -> float32, normalised with MEAN and STD (where ``x`` lives)."""
    mean, inv = _scale(x.device)
    return (x.float() - mean) * inv


@functools.cache
def _scale(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(MEAN x 255, 1 / (STD x 255)) on ``device``, made once: a tensor built from a list on a
    GPU is a blocking copy, which before every batch made the host wait for the GPU's queued
    steps, so it could never launch ahead of them."""
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1) * 255
    inv = 1 / (torch.tensor(STD, device=device).view(1, 3, 1, 1) * 255)
    return mean, inv


@dataclass
class Normalised:
    """The loader's uint8 batches, normalised on their device (the GPU's, in training)."""

    inner: Any  # LoaderTrainData or LoaderEvalData

    def batches(self, *args: int) -> Iterator[Batch]:
        return ((normalise(x), y) for x, y in self.inner.batches(*args))

    def starvation(self, epoch: int) -> str | None:
        return self.inner.starvation(epoch) if hasattr(self.inner, "starvation") else None


def split_dirs(root: Path) -> tuple[Path, Path]:
    """(train, test) folders of an image-folder dataset; test may be named val."""
    train = root / "train"
    test = next((root / n for n in TEST_SPLITS if (root / n).is_dir()), root / "test")
    for folder in (train, test):
        if not folder.is_dir():
            raise ImageFolderError(f"{root} has no {folder.name}/ folder", hint=folder_hint())
    return train, test


def synthetic_folder(cfg: TrainConfig) -> Path:
    """Where ``--synthetic`` writes the image folder of ``cfg`` (its own folder under data_dir)."""
    per_class = _per_class(cfg)
    size = cfg.image_size or SYNTHETIC_SIZE
    name = f"synthetic-imagefolder-{per_class[0]}-{per_class[1]}-{size}px"
    return Path(cfg.data_dir) / name


def _per_class(cfg: TrainConfig) -> tuple[int, int]:
    return (
        max(cfg.synthetic_train_size // SYNTHETIC_CLASSES, 1),
        max(cfg.synthetic_test_size // SYNTHETIC_CLASSES, 1),
    )


def stage_synthetic(cfg: TrainConfig) -> None:
    """Write the synthetic folder unless it is there (local rank 0; the staging lock)."""
    from hpc_ddp.train.cifar.data import _staging_lock

    data_dir = Path(cfg.data_dir)
    if not data_dir.is_dir():
        data_dir.mkdir(parents=True, exist_ok=True)
        print(f"created data dir {data_dir} for the synthetic image folder", flush=True)
    folder = synthetic_folder(cfg)
    train, test = _per_class(cfg)
    size = cfg.image_size or SYNTHETIC_SIZE
    kind = dict(classes=SYNTHETIC_CLASSES, train=train, test=test, size=size, fmt="png", seed=1234)
    with _staging_lock(data_dir):
        if not image_synthetic.is_current(folder, **kind):
            log.info(f"writing a synthetic image folder ({kind}) to {folder}")
            image_synthetic.write_image_folder(
                folder, classes=SYNTHETIC_CLASSES, train_per_class=train, test_per_class=test,
                size=size, processes=max(min(loader_settings.usable_cores(), 8), 1),
            )  # fmt: skip


def read_splits(cfg: TrainConfig, root: Path) -> tuple[ImageFolderDataset, ImageFolderDataset]:
    """Both splits of the image folder at ``root``, with the same classes."""
    train_dir, test_dir = split_dirs(root)
    size = cfg.image_size
    train = ImageFolderDataset(
        train_dir, augment=cfg.augment, seed=cfg.seed, size=size, normalise=False
    )
    test = ImageFolderDataset(test_dir, seed=cfg.seed, size=train.size, normalise=False)
    if train.classes != test.classes:
        raise ImageFolderError(
            f"{train_dir} and {test_dir} have different class folders "
            f"({len(train.classes)} and {len(test.classes)})",
            hint="both splits need the same class folders, by name",
        )
    checked = train.item(0)  # the first item now: a broken file fails before training starts
    del checked
    return train, test
