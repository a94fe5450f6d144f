"""CIFAR's pickled batches, decoded once into .npy files beside them.

The batches are Python 2 pickles: the pixels come back as a 150 MB latin-1 string that pickle
re-encodes to bytes on every read, a large part of a short run's start (benchmarks/NOTES.md). A
memory-mapped .npy of the same array reads at once.

The synthetic generator caches the batches it writes (it holds the arrays already), so even a
run's first read of them decodes nothing.

The cache sits in ``.hpc-ddp-cache/`` next to the batch files and records the source file's size
and mtime: a replaced source is read from the pickle again (and re-cached). Writes are atomic
(temp file + rename), so ranks that race to create it all end up reading a whole file; a
read-only data directory simply goes uncached.

The data directory may be shared and writable by others, so nothing read from it can run code:
the batches go through ``cifar_pickle``'s restricted unpickler, the cache is read with
``allow_pickle=False`` (an object array is refused, not unpickled) after its header is checked
against the file's size and the dtype a split has, and every read opens a regular file only. A
symlink where the cache directory or a file of it belongs is not written through: that split
stays uncached.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from numpy.lib import format as npformat

from hpc_ddp.regular_file import open_regular, read_json
from hpc_ddp.train.cifar import safe_pickle as cifar_pickle

CACHE_DIR = ".hpc-ddp-cache"
FORMAT = 1
STAMP_MAX_BYTES = 4096


def read_batch(path: Path, label_keys: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 pixels as stored, int64 labels) of one batch file, from the cache when current."""
    cached = _load(path)
    if cached is not None:
        return cached
    images, labels = cifar_pickle.batch_arrays(cifar_pickle.load(path), path, label_keys)
    store(path, images, labels)
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
        if read_json(stamp_path, STAMP_MAX_BYTES) != _stamp(source):
            return None
        # A private copy, not a memory map: callers may write into it; the read is still one
        # sequential pass over the file.
        images, labels = _read_npy(images_path, np.uint8), _read_npy(labels_path, np.int64)
    except (OSError, ValueError):
        return None
    if images.ndim != 2 or labels.shape != (len(images),):
        return None
    return images, labels


def _read_npy(path: Path, dtype: type[np.generic]) -> np.ndarray:
    """A .npy of ``dtype`` whose header matches the file's size (a crafted header cannot make
    the reader allocate more than the file holds); never unpickles."""
    with open_regular(path) as fh:
        version = npformat.read_magic(fh)
        read_header = {
            (1, 0): npformat.read_array_header_1_0,
            (2, 0): npformat.read_array_header_2_0,
        }
        if version not in read_header:
            raise ValueError(f"{path}: .npy format {version} (this cache writes 1.0)")
        shape, _fortran, found = read_header[version](fh)
        size = os.fstat(fh.fileno()).st_size
        if found != np.dtype(dtype) or fh.tell() + math.prod(shape) * found.itemsize != size:
            raise ValueError(f"{path}: not a {np.dtype(dtype)} array of the file's size")
        fh.seek(0)
        return np.load(fh, allow_pickle=False)


def store(source: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Cache the arrays of the finished batch file ``source`` (what ``read_batch`` would
    decode from it); a directory that cannot take the cache is left uncached."""
    paths = _paths(source)
    try:
        folder = paths[0].parent
        folder.mkdir(exist_ok=True)
        if folder.is_symlink():  # written through, it would put files wherever it points
            return
        stamp = _stamp(source)
        # The stamp goes last: a reader only trusts arrays that a finished write left behind.
        for path, array in zip(paths[:2], (images, labels), strict=True):
            _replace(path, lambda fh, a=array: np.save(fh, a, allow_pickle=False))
        _replace(paths[2], lambda fh: fh.write(json.dumps(stamp).encode()))
    except OSError:
        pass  # read-only or full data dir: stay uncached, the pickle still works


def _replace(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` through a new temporary file (O_EXCL | O_NOFOLLOW: never through a file
    or symlink someone left under that name), then rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
