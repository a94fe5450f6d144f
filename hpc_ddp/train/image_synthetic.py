"""Write a synthetic image-folder dataset: ``train/<class>/*.png`` and ``test/<class>/*.png``.

The shape of most users' image data on disk (torchvision's ``ImageFolder``: a folder per class
of encoded files), so that the trainer's path for it (image_folder.py) is exercised and measured
on files it has to open and decode, at the sizes that matter (64 px, 224 px). Each class has a
colour and a coarse 4x4 pattern, scaled to the image's size; each image adds its own noise and
shift, so a small model learns it within a few epochs. Every image is a function of (seed,
split, class, number) alone: the same files on every run and machine (for one Pillow version),
and they may be written in parallel (``processes``).

    python -m hpc_ddp.train.image_synthetic OUT --classes 100 --per-class 100 --size 224
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.regular_file import read_json

MARKER = "hpc-ddp-synthetic.json"
VERSION = 1  # bump whenever the images change
FORMATS = {"png": "PNG", "jpeg": "JPEG"}
SPLITS = ("train", "test")
MAX_SIZE = 1024  # pixels per side
MAX_IMAGES = 10_000_000


def class_name(label: int) -> str:
    return f"class_{label:03d}"


def _template(seed: int, label: int, size: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 0, label])
    colour = rng.uniform(40, 215, size=(1, 1, 3))
    pattern = rng.uniform(-60, 60, size=(4, 4, 3))
    cell = -(-size // 4)
    big = pattern.repeat(cell, axis=0).repeat(cell, axis=1)[:size, :size]
    return colour + big  # (size, size, 3) float, HWC


def image(seed: int, split: str, label: int, number: int, size: int) -> np.ndarray:
    """One image, HWC uint8: the class's template shifted a little, plus noise."""
    rng = np.random.default_rng([seed, 1 + SPLITS.index(split), label, number])
    base = _template(seed, label, size)
    shift = rng.integers(-size // 16, size // 16 + 1, size=2)
    base = np.roll(base, tuple(int(s) for s in shift), axis=(0, 1))
    noise = rng.normal(0, 40, size=(size, size, 3))
    return np.clip(base + noise, 0, 255).astype(np.uint8)


def encode(pixels: np.ndarray, fmt: str) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    kwargs = {"quality": 90} if fmt == "jpeg" else {"compress_level": 1}
    Image.fromarray(pixels).save(out, format=FORMATS[fmt], **kwargs)
    return out.getvalue()


def _write_class(args: tuple[Path, int, str, int, int, int, str]) -> None:
    folder, seed, split, label, count, size, fmt = args
    target = folder / split / class_name(label)
    target.mkdir(parents=True, exist_ok=True)
    for number in range(count):
        data = encode(image(seed, split, label, number, size), fmt)
        (target / f"{number:06d}.{fmt if fmt == 'png' else 'jpg'}").write_bytes(data)


def marker(classes: int, train: int, test: int, size: int, fmt: str, seed: int) -> dict:
    return {"kind": "image-folder", "classes": classes, "train_per_class": train,
            "test_per_class": test, "size": size, "format": fmt, "seed": seed,
            "version": VERSION}  # fmt: skip


def is_current(folder: Path, **kind: int | str) -> bool:
    try:
        return read_json(Path(folder) / MARKER, 4096) == marker(**kind)  # type: ignore[arg-type]
    except (OSError, ValueError):
        return False


def write_image_folder(
    folder: Path,
    *,
    classes: int,
    train_per_class: int,
    test_per_class: int,
    size: int,
    fmt: str = "png",
    seed: int = 1234,
    processes: int = 1,
) -> Path:
    """Write the dataset as ``folder`` (atomically: a temporary sibling, then a rename).
    ``folder`` may exist only as a dataset this generator wrote: it is replaced then."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    if not (
        1 <= size <= MAX_SIZE and classes >= 1 and train_per_class >= 1 and test_per_class >= 1
    ):
        raise ValueError("classes, images per class and size must be positive (size <= 1024)")
    if classes * (train_per_class + test_per_class) > MAX_IMAGES:
        raise ValueError(f"more than {MAX_IMAGES} images")
    folder = Path(folder)
    _check_replaceable(folder)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    jobs = [
        (
            tmp,
            seed,
            split,
            label,
            train_per_class if split == "train" else test_per_class,
            size,
            fmt,
        )
        for split in SPLITS
        for label in range(classes)
    ]
    if processes > 1:
        with ProcessPoolExecutor(processes) as pool:
            list(pool.map(_write_class, jobs))
    else:
        for job in jobs:
            _write_class(job)
    info = marker(classes, train_per_class, test_per_class, size, fmt, seed)
    (tmp / MARKER).write_text(json.dumps(info))
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return folder


def _check_replaceable(folder: Path) -> None:
    """Only a folder this generator wrote (its MARKER) is ever replaced: any other is the
    user's."""
    if not os.path.lexists(folder):
        return
    ours = not folder.is_symlink() and isinstance(_read_marker(folder), dict)
    if not ours:
        raise HpcDdpError(
            f"{folder} exists and is not a synthetic image folder hpc-ddp wrote (no {MARKER} "
            "in it): refusing to replace it",
            hint="name another folder, or move that one away",
        )


def _read_marker(folder: Path) -> object:
    try:
        info = read_json(folder / MARKER, 4096)
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and info.get("kind") == "image-folder" else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpc_ddp.train.image_synthetic", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("folder", type=Path, help="the dataset folder to write (train/, test/)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--per-class", type=int, default=100, help="training images per class")
    parser.add_argument("--test-per-class", type=int, default=20)
    parser.add_argument("--size", type=int, default=64, help="pixels per side (64, 224, ...)")
    parser.add_argument("--format", choices=tuple(FORMATS), default="png")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--processes", type=int, default=os.cpu_count() or 1)
    a = parser.parse_args(argv)
    kind = dict(classes=a.classes, train=a.per_class, test=a.test_per_class, size=a.size,
                fmt=a.format, seed=a.seed)  # fmt: skip
    if is_current(a.folder, **kind):
        print(f"{a.folder}: already written")
        return 0
    try:
        write_image_folder(
            a.folder, classes=a.classes, train_per_class=a.per_class,
            test_per_class=a.test_per_class, size=a.size, fmt=a.format, seed=a.seed,
            processes=max(a.processes, 1),
        )  # fmt: skip
    except (HpcDdpError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"{a.folder}: {a.classes} classes x {a.per_class}+{a.test_per_class} {a.format} "
          f"images at {a.size} px")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
