"""Write a synthetic, learnable dataset in CIFAR-10/100's exact on-disk format.

There is no internet here, and tests must exercise torchvision's real CIFAR10/CIFAR100 loading
code, so this writes what the official tarballs unpack to: ``cifar-10-batches-py/`` (pickled
``data_batch_1..5``, ``test_batch``, ``batches.meta``) or ``cifar-100-python/`` (``train``,
``test``, ``meta``). Each class has a colour and a coarse 4x4 pattern; samples add noise, so a
LeNet learns it in an epoch or two while it is still not trivially separable per pixel.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

FOLDERS = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}
NUM_CLASSES = {"cifar10": 10, "cifar100": 100}
MARKER = "hpc-ddp-synthetic.json"
GENERATOR_VERSION = 1


def synthetic_root(data_dir: Path, dataset: str, train_size: int, test_size: int) -> Path:
    """Synthetic data lives in its own subdirectory so it never shadows a real staged copy."""
    return Path(data_dir) / f"synthetic-{dataset}-{train_size}-{test_size}"


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


def _dump(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)
        f.flush()
        os.fsync(f.fileno())


def is_current(root: Path, dataset: str, train_size: int, test_size: int, seed: int) -> bool:
    marker = root / FOLDERS[dataset] / MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return info == _marker(dataset, train_size, test_size, seed)


def _marker(dataset: str, train_size: int, test_size: int, seed: int) -> dict:
    return {
        "dataset": dataset,
        "train_size": train_size,
        "test_size": test_size,
        "seed": seed,
        "version": GENERATOR_VERSION,
    }


def write_synthetic(
    root: Path,
    dataset: str,
    *,
    train_size: int,
    test_size: int,
    seed: int = 1234,
    noise: float = 48.0,
) -> Path:
    """Write the dataset under ``root`` (atomically: temp dir + rename). Returns its folder."""
    if dataset not in FOLDERS:
        raise ValueError(f"unknown dataset {dataset!r}")
    root = Path(root)
    final = root / FOLDERS[dataset]
    tmp = root / f".{FOLDERS[dataset]}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    classes = NUM_CLASSES[dataset]
    templates = _templates(classes, seed)
    rng = np.random.default_rng(seed + 1)
    train_x, train_y = _samples(templates, train_size, rng, noise)
    test_x, test_y = _samples(templates, test_size, rng, noise)
    names = [f"class_{i:03d}" for i in range(classes)]
    if dataset == "cifar10":
        chunks = np.array_split(np.arange(train_size), 5)
        for i, idx in enumerate(chunks, start=1):
            _dump(
                tmp / f"data_batch_{i}", _batch(f"training batch {i} of 5", train_x, train_y, idx)
            )
        _dump(tmp / "test_batch", _batch("testing batch 1 of 1", test_x, test_y, range(test_size)))
        meta = {"label_names": names, "num_cases_per_batch": len(chunks[0]), "num_vis": 3072}
        _dump(tmp / "batches.meta", meta)
    else:
        for split, x, y in (("train", train_x, train_y), ("test", test_x, test_y)):
            _dump(
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
    (tmp / MARKER).write_text(json.dumps(_marker(dataset, train_size, test_size, seed)))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def _batch(label: str, x: np.ndarray, y: list[int], idx: Iterable[int]) -> dict:
    idx = list(idx)
    return {
        "batch_label": label,
        "labels": [y[i] for i in idx],
        "data": x[idx],
        "filenames": [f"synthetic_{i}.png" for i in idx],
    }
