"""Write a synthetic, learnable dataset in CIFAR-10/100's exact on-disk format.

There is no internet here, and tests must exercise torchvision's real CIFAR10/CIFAR100 loading
code, so this writes what the official tarballs unpack to: ``cifar-10-batches-py/`` (pickled
``data_batch_1..5``, ``test_batch``, ``batches.meta``) or ``cifar-100-python/`` (``train``,
``test``, ``meta``). Two variants (``variant=``), each under its own ``synthetic_root``:

* ``easy`` (the default): each class has a colour and a coarse 4x4 pattern, samples add noise; a
  LeNet learns it in an epoch or two (~100 % test accuracy), while it is still not trivially
  separable per pixel. Tests rely on that.
* ``hard``: each class is a combination of 3 strokes (short blurred coloured segments) out of a
  shared pool of 14, on one of 4 background colours, so classes share parts and only the
  combination identifies one. Every sample is translated (+-5 px), its strokes jittered (position,
  angle, length, strength), each stroke dropped with probability 1/4, the strokes of another class
  blended in at 0.5-0.85 strength as a distractor, brightness/contrast/colour jittered, plus
  strong pixel noise. Some samples are ambiguous, so accuracy saturates well below 100 % and a
  comparison of final accuracies can tell two training scripts apart (LeNet's curve on it:
  benchmarks/NOTES.md). Vectorised over the samples, so a CIFAR-sized split takes seconds.
  Deterministic for a seed on a given machine (float32 math). Its knobs: ``_HardKnobs``.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist
from typing import Any

import numpy as np

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.regular_file import read_json
from hpc_ddp.train.cifar import safe_pickle as cifar_pickle
from hpc_ddp.train.fast import array_cache

FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
MARKER = "hpc-ddp-synthetic.json"
GENERATOR_VERSION = 1  # the easy variant's; its marker keeps the original (variant-less) form
HARD_VERSION = 1  # bump whenever the hard variant's output changes
VARIANTS = ("easy", "hard")


def synthetic_root(
    data_dir: Path, dataset: str, train_size: int, test_size: int, variant: str = "easy"
) -> Path:
    """Synthetic data lives in its own subdirectory so it never shadows a real staged copy;
    each variant has its own (easy: no suffix, so existing easy copies stay found; others:
    ``-<variant>``)."""
    _check_variant(variant)
    suffix = "" if variant == "easy" else f"-{variant}"
    return Path(data_dir) / f"synthetic-{dataset}-{train_size}-{test_size}{suffix}"


def _check_variant(variant: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(
            f"unknown synthetic variant {variant!r} (use one of {', '.join(VARIANTS)})"
        )


def _templates(num_classes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    colour = rng.uniform(40, 215, size=(num_classes, 3, 1, 1))
    pattern = rng.uniform(-60, 60, size=(num_classes, 3, 4, 4)).repeat(8, axis=2).repeat(8, axis=3)
    return colour + pattern  # (C, 3, 32, 32)


def _samples(
    templates: np.ndarray, n: int, rng: np.random.Generator, noise: float
) -> tuple[np.ndarray, list[int]]:
    labels = rng.integers(0, len(templates), size=n)
    images = templates[labels] + rng.normal(0, noise, size=(n, 3, 32, 32))
    data = np.clip(images, 0, 255).astype(np.uint8).reshape(n, 3072)
    return data, [int(x) for x in labels]


@dataclass(frozen=True)
class _HardKnobs:
    """The hard variant's difficulty (changing any of them needs a ``HARD_VERSION`` bump)."""

    pool: int = 14  # strokes shared by all classes
    parts: int = 3  # strokes per class (a distinct combination each)
    backgrounds: int = 4  # background colours shared by all classes
    shift: float = 5.0  # whole-sample translation, uniform +- px
    jitter: float = 1.5  # per-stroke position jitter, normal sd px
    angle_jitter: float = 0.2  # per-stroke rotation, normal sd rad
    drop: float = 0.25  # probability that a stroke is missing
    distractor: tuple[float, float] = (0.5, 0.85)  # strength of another class's strokes
    distractor_shift: float = 6.0
    contrast: tuple[float, float] = (0.6, 1.3)
    brightness: float = 20.0  # normal sd, grey levels
    colour: float = 20.0  # per-channel offset, normal sd
    noise: float = 50.0  # per-pixel sd (a normal quantised to 256 values)


_HARD = _HardKnobs()
# A standard normal quantised to 256 equally likely values (its quantiles), indexed by a byte.
_NORMAL_256 = np.array([NormalDist().inv_cdf((i + 0.5) / 256) for i in range(256)], np.float32)


@dataclass(frozen=True)
class _HardSpec:
    strokes: np.ndarray  # (pool, 5) float32: centre x, centre y, angle, half length, width
    colours: np.ndarray  # (pool, 3) float32: each stroke's colour
    parts: np.ndarray  # (classes, parts) int: the strokes of each class
    background: np.ndarray  # (classes, 3) float32


def _hard_classes(num_classes: int, seed: int, k: _HardKnobs = _HARD) -> _HardSpec:
    rng = np.random.default_rng(seed)
    strokes = np.stack(
        [
            rng.uniform(8, 24, k.pool),
            rng.uniform(8, 24, k.pool),
            rng.uniform(0, np.pi, k.pool),
            rng.uniform(3, 8, k.pool),
            rng.uniform(1.0, 2.2, k.pool),
        ],
        axis=1,
    ).astype(np.float32)
    colours = rng.uniform(20, 235, size=(k.pool, 3)).astype(np.float32)
    combos: dict[tuple[int, ...], None] = {}  # insertion-ordered set
    while len(combos) < num_classes:
        combos[tuple(sorted(int(i) for i in rng.choice(k.pool, k.parts, replace=False)))] = None
    palette = rng.uniform(60, 190, size=(k.backgrounds, 3))
    background = palette[rng.integers(0, k.backgrounds, num_classes)].astype(np.float32)
    return _HardSpec(strokes, colours, np.array(list(combos)), background)


def _hard_samples(
    spec: _HardSpec, n: int, rng: np.random.Generator, k: _HardKnobs = _HARD, chunk: int = 1024
) -> tuple[np.ndarray, list[int]]:
    """Draw every sample's parameters up front, then render the pixels ``chunk`` at a time."""
    classes, parts = spec.parts.shape
    labels = rng.integers(0, classes, size=n)
    other = (labels + rng.integers(1, classes, size=n)) % classes  # the distractor's class
    f32 = np.float32
    # Per stroke (the class's `parts`, then the distractor's): offset, rotation, length, strength.
    shift = np.concatenate(
        [
            np.repeat(rng.uniform(-k.shift, k.shift, (n, 1, 2)), parts, axis=1),
            np.repeat(rng.uniform(-k.distractor_shift, k.distractor_shift, (n, 1, 2)), parts, 1),
        ],
        axis=1,
    )
    offset = (shift + rng.normal(0, k.jitter, (n, 2 * parts, 2))).astype(f32)
    rotate = rng.normal(0, k.angle_jitter, (n, 2 * parts)).astype(f32)
    stretch = rng.uniform(0.8, 1.2, (n, 2 * parts)).astype(f32)
    strength = (rng.random((n, 2 * parts)) >= k.drop) * rng.uniform(0.6, 1.0, (n, 2 * parts))
    strength[:, parts:] *= rng.uniform(*k.distractor, (n, 1))
    contrast = rng.uniform(*k.contrast, (n, 1))
    base = 128 * (1 - contrast) + rng.normal(0, k.brightness, (n, 1))
    base = base + rng.normal(0, k.colour, (n, 3)) + contrast * spec.background[labels]
    grid = np.arange(32, dtype=f32)
    noise = _NORMAL_256 * f32(k.noise)  # drawing bytes is much cheaper than drawing normals
    out = np.empty((n, 3072), dtype=np.uint8)
    for lo in range(0, n, chunk):
        sl = slice(lo, min(lo + chunk, n))
        idx = np.concatenate([spec.parts[labels[sl]], spec.parts[other[sl]]], axis=1)
        stroke = spec.strokes[idx]  # (m, 2 * parts, 5)
        cx = stroke[..., 0] + offset[sl, :, 0]
        cy = stroke[..., 1] + offset[sl, :, 1]
        angle = stroke[..., 2] + rotate[sl]
        ux, uy = np.cos(angle)[..., None], np.sin(angle)[..., None]
        dx, dy = grid - cx[..., None], grid - cy[..., None]  # (m, 2 * parts, 32)
        # Distance to the segment: across it, and beyond its ends along it.
        along = np.abs((dy * uy)[..., :, None] + (dx * ux)[..., None, :])  # (m, s, 32, 32)
        across = (dy * ux)[..., :, None] - (dx * uy)[..., None, :]
        along -= (stroke[..., 3] * stretch[sl])[..., None, None]
        np.maximum(along, 0, out=along)
        along *= along
        across *= across
        along += across
        along *= (-0.5 / stroke[..., 4] ** 2)[..., None, None]
        ink = np.exp(along, out=along).reshape(len(idx), 2 * parts, 1024)
        # Blend each stroke's colour over the background by its ink, then the photometric jitter.
        tint = spec.colours[idx] - spec.background[labels[sl]][:, None, :]  # (m, s, 3)
        weight = (contrast[sl, :, None] * strength[sl, :, None] * tint).astype(f32)
        img = np.matmul(weight.transpose(0, 2, 1), ink)  # (m, 3, 1024)
        img += base[sl, :, None].astype(f32)
        img += noise[rng.integers(0, 256, img.shape, dtype=np.uint8)]
        np.clip(img, 0, 255, out=img)
        out[sl] = img.reshape(len(idx), 3072)
    return out, [int(x) for x in labels]


def _dump_batch(path: Path, batch: dict) -> None:
    """Write a batch file and its array cache, the arrays a read of the file gives (the same
    ``batch_arrays``): a run's first read then skips decoding the pickle (the cost
    array_cache's docstring gives)."""
    _dump(path, batch)
    array_cache.store(path, *cifar_pickle.batch_arrays(batch, path, cifar_pickle.LABEL_KEYS))


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)
        f.flush()
        os.fsync(f.fileno())


def is_current(
    root: Path, dataset: str, train_size: int, test_size: int, seed: int, variant: str = "easy"
) -> bool:
    info = _read_marker(Path(root) / FOLDERS[dataset])
    return info == _marker(dataset, train_size, test_size, seed, variant)


def _read_marker(folder: Path) -> Any:
    """The generator's marker in ``folder``, or None. A regular file only: a FIFO planted in a
    shared data dir would block the read."""
    try:
        return read_json(folder / MARKER, 4096)
    except (OSError, ValueError):
        return None


def _marker(dataset: str, train_size: int, test_size: int, seed: int, variant: str) -> dict:
    _check_variant(variant)
    info = {"dataset": dataset, "train_size": train_size, "test_size": test_size, "seed": seed}
    if variant == "easy":  # unchanged since before variants existed: staged copies stay current
        return {**info, "version": GENERATOR_VERSION}
    return {**info, "variant": variant, "version": HARD_VERSION}


def write_synthetic(
    root: Path,
    dataset: str,
    *,
    train_size: int,
    test_size: int,
    seed: int = 1234,
    noise: float = 48.0,
    variant: str = "easy",
) -> Path:
    """Write the dataset under ``root`` (atomically: temp dir + rename). Returns its folder.

    ``noise`` is the easy variant's pixel noise; the hard one has its own settings (``_HARD``).
    """
    if dataset not in FOLDERS:
        raise ValueError(f"unknown dataset {dataset!r}")
    _check_variant(variant)
    root = Path(root)
    final = root / FOLDERS[dataset]
    _check_replaceable(final)
    tmp = root / f".{FOLDERS[dataset]}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    classes = NUM_CLASSES[dataset]
    if variant == "easy":
        templates = _templates(classes, seed)
        rng = np.random.default_rng(seed + 1)
        train_x, train_y = _samples(templates, train_size, rng, noise)
        test_x, test_y = _samples(templates, test_size, rng, noise)
    else:
        spec = _hard_classes(classes, seed)
        rng = np.random.default_rng(seed + 1)
        train_x, train_y = _hard_samples(spec, train_size, rng)
        test_x, test_y = _hard_samples(spec, test_size, rng)
    names = [f"class_{i:03d}" for i in range(classes)]
    if dataset == "cifar10":
        chunks = np.array_split(np.arange(train_size), 5)
        for i, idx in enumerate(chunks, start=1):
            batch = _batch(f"training batch {i} of 5", train_x, train_y, idx)
            _dump_batch(tmp / f"data_batch_{i}", batch)
        test = _batch("testing batch 1 of 1", test_x, test_y, range(test_size))
        _dump_batch(tmp / "test_batch", test)
        meta = {"label_names": names, "num_cases_per_batch": len(chunks[0]), "num_vis": 3072}
        _dump(tmp / "batches.meta", meta)
    else:
        for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
            _dump_batch(
                tmp / split,
                {
                    "filenames": [f"synthetic_{i}.png" for i in range(len(y))],
                    "batch_label": f"{split} synthetic",
                    "fine_labels": y,
                    "coarse_labels": [label // 5 for label in y],
                    "data": x,
                },
            )
        coarse = [f"superclass_{i:02d}" for i in range(20)]
        _dump(tmp / "meta", {"fine_label_names": names, "coarse_label_names": coarse})
    marker = _marker(dataset, train_size, test_size, seed, variant)
    (tmp / MARKER).write_text(json.dumps(marker))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def _check_replaceable(final: Path) -> None:
    """Refuse to replace ``final`` unless it is a synthetic set this generator wrote (its
    MARKER names a dataset): a folder of the user's by that name is theirs, never removed."""
    if not os.path.lexists(final):
        return
    info = None if final.is_symlink() else _read_marker(final)
    ours = isinstance(info, dict) and "dataset" in info
    if not ours:
        raise HpcDdpError(
            f"{final} exists and is not a synthetic dataset hpc-ddp wrote (no {MARKER} in a "
            "real dir): refusing to replace it",
            hint="point --data-dir at another dir for the synthetic data, or move that one away",
        )


def _batch(label: str, x: np.ndarray, y: list[int], idx: Iterable[int]) -> dict:
    idx = list(idx)
    return {
        "batch_label": label,
        "labels": [y[i] for i in idx],
        "data": x[idx],
        "filenames": [f"synthetic_{i}.png" for i in idx],
    }
