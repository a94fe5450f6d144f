"""CIFAR's pickled batches, decoded once into .npy files beside them.

The batches are Python 2 pickles: the pixels come back as a 150 MB latin-1 string that pickle
re-encodes to bytes, ~0.7 s per read of CIFAR-100's train file on a 2-core CPU and 1.4-1.7 s of
every run's start on the H200 machines (benchmarks/NOTES.md). A memory-mapped .npy of the same
array reads in milliseconds.

The cache sits in ``.hpc-ddp-cache/`` next to the batch files and records the source file's size
and mtime: a replaced source is read from the pickle again (and re-cached). Writes are atomic
(temp file + rename), so ranks that race to create it all end up reading a whole file; a
read-only data directory simply goes uncached.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np

CACHE_DIR = ".hpc-ddp-cache"
FORMAT = 1


def read_batch(path: Path, label_keys: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 pixels as stored, int64 labels) of one batch file, from the cache when current."""
    cached = _load(path)
    if cached is not None:
        return cached
    with path.open("rb") as fh:
        entry = pickle.load(fh, encoding="latin1")
    key = next(k for k in label_keys if k in entry)
    images = np.asarray(entry["data"], dtype=np.uint8)
    labels = np.asarray(entry[key], dtype=np.int64)
    _store(path, images, labels)
    return images, labels


def _paths(source: Path) -> tuple[Path, Path, Path]:
    folder = source.parent / CACHE_DIR
    return (
        folder / f"{source.name}.images.npy",
        folder / f"{source.name}.labels.npy",
        folder / f"{source.name}.json",
    )


def _stamp(source: Path) -> dict[str, Any]:
    st = source.stat()
    return {"format": FORMAT, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _load(source: Path) -> tuple[np.ndarray, np.ndarray] | None:
    images_path, labels_path, stamp_path = _paths(source)
    try:
        if json.loads(stamp_path.read_text()) != _stamp(source):
            return None
        # A private copy, not a memory map: callers may write into it; the read is still one
        # sequential pass over the file.
        return np.load(images_path), np.load(labels_path)
    except (OSError, ValueError):
        return None


def _store(source: Path, images: np.ndarray, labels: np.ndarray) -> None:
    paths = _paths(source)
    try:
        paths[0].parent.mkdir(exist_ok=True)
        stamp = _stamp(source)
        # The stamp goes last: a reader only trusts arrays that a finished write left behind.
        for path, array in zip(paths[:2], (images, labels), strict=True):
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            with tmp.open("wb") as fh:
                np.save(fh, array)
            os.replace(tmp, path)
        tmp = paths[2].with_name(f".{paths[2].name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(stamp))
        os.replace(tmp, paths[2])
    except OSError:
        pass  # read-only or full data dir: stay uncached, the pickle still works
