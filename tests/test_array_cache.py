"""The .npy cache of CIFAR's pickled batches (train/array_cache.py): same arrays, never stale."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from hpc_ddp.train.cifar import safe_pickle as cifar_pickle
from hpc_ddp.train.cifar import synthetic
from hpc_ddp.train.cifar.data import CIFAR_FILES
from hpc_ddp.train.fast import array_cache
from hpc_ddp.train.fast.gpu_data import load_cifar_arrays

KEYS = cifar_pickle.LABEL_KEYS


def write_batch(path: Path, pixels: np.ndarray, labels: list[int]) -> None:
    with path.open("wb") as fh:
        pickle.dump({"data": pixels, "fine_labels": labels}, fh, protocol=2)  # CIFAR's format


def test_the_cache_is_what_reads_use(tmp_path: Path) -> None:
    """The generator cached every split; a later read takes the cache and never opens the
    pickle (that the cache holds the pickle's arrays: the test below)."""
    root = synthetic.synthetic_root(tmp_path, "cifar100", 64, 16)
    synthetic.write_synthetic(root, "cifar100", train_size=64, test_size=16)
    first = load_cifar_arrays(root, "cifar100", train=True)
    cache = root / "cifar-100-python" / array_cache.CACHE_DIR
    assert sorted(p.name for p in cache.iterdir()) == [
        f"{split}.{part}"
        for split in ("test", "train")
        for part in ("images.npy", "json", "labels.npy")
    ]
    # Poison the pickle's bytes but keep its size and mtime: a cached read never opens it.
    source = root / "cifar-100-python" / "train"
    st = source.stat()
    source.write_bytes(b"\0" * st.st_size)
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    second = load_cifar_arrays(root, "cifar100", train=True)
    for a, b in zip(first, second, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


@pytest.mark.parametrize("dataset", ["cifar10", "cifar100"])
def test_the_generator_caches_exactly_what_its_pickles_hold(tmp_path: Path, dataset: str) -> None:
    """A run's first read of synthetic data decodes nothing: the generator cached each batch,
    and the cache holds what decoding the pickle gives (same dtype, shape and values)."""
    root = synthetic.synthetic_root(tmp_path, dataset, 50, 20, "hard")
    folder = synthetic.write_synthetic(root, dataset, train_size=50, test_size=20, variant="hard")
    _, train_files, test_files = CIFAR_FILES[dataset]  # the files the reader opens
    for path in (folder / name for name in train_files + test_files):
        cached = array_cache._load(path)
        assert cached is not None, f"{path.name} was not cached by the generator"
        decoded = cifar_pickle.batch_arrays(cifar_pickle.load(path), path, KEYS)
        for a, b in zip(cached, decoded, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_a_replaced_source_is_read_again(tmp_path: Path) -> None:
    source = tmp_path / "train"
    write_batch(source, np.zeros((2, 3072), np.uint8), [1, 2])
    images, labels = array_cache.read_batch(source, KEYS)
    assert labels.tolist() == [1, 2] and not images.any()
    write_batch(source, np.full((3, 3072), 7, np.uint8), [3, 4, 5])  # new size: a new stamp
    images, labels = array_cache.read_batch(source, KEYS)
    assert labels.tolist() == [3, 4, 5] and (images == 7).all()
    assert array_cache._load(source) is not None  # the new read was cached under the new stamp
    assert array_cache.read_batch(source, KEYS)[1].tolist() == [3, 4, 5]  # now from the cache


def test_an_unwritable_cache_dir_is_not_an_error(tmp_path: Path) -> None:
    """Read-only data dirs take the same path (OSError on write): the pickle still serves."""
    source = tmp_path / "train"
    write_batch(source, np.ones((2, 3072), np.uint8), [0, 1])
    (tmp_path / array_cache.CACHE_DIR).write_text("a file where the cache dir would go")
    assert array_cache.read_batch(source, KEYS)[1].tolist() == [0, 1]
