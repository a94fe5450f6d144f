"""CIFAR's python-format batches, unpickled by a loader that can only rebuild what they hold.

The official files are pickles, and ``pickle.load`` runs whatever callable a file names: anyone
who can write to a shared ``--data-dir`` could run code in every job that reads it. A batch holds
a dict of strings, lists of ints and strings, and one uint8 numpy array; rebuilding those needs
three globals (numpy's array reconstructor, ``numpy.ndarray``, ``numpy.dtype``) plus
``_codecs.encode`` (Python 3 writes bytes that way in protocol 2). Those four are replaced by
checked stand-ins and everything else is refused before it is looked up, so nothing named by
the file is ever imported or called. Files are opened as regular files only (a FIFO or a device
planted in their place is refused instead of blocking or never ending).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from hpc_ddp.regular_file import open_regular

# A batch holds one array (``data``); the meta files none. A file that builds more is no CIFAR
# file, and refusing early bounds how much memory a crafted file can make the reader allocate.
MAX_ARRAYS = 4
# Where a batch keeps its labels: CIFAR-10's "labels", CIFAR-100's "fine_labels" (the first
# one present is read).
LABEL_KEYS = ("labels", "fine_labels")


class NotCifarFileError(pickle.UnpicklingError):
    """The file is not one of CIFAR's python-format batches: refused without running it."""


class _CifarUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="latin1")  # the official files are Python 2 pickles
        self.path = path
        self.arrays = 0

    def refuse(self, what: str) -> NotCifarFileError:
        return NotCifarFileError(
            f"{self.path} is not a CIFAR batch: it {what}; refused without running it "
            "(CIFAR's files only hold strings, lists of ints and one uint8 array)"
        )

    def find_class(self, module: str, name: str) -> Any:
        allowed = {
            ("numpy.core.multiarray", "_reconstruct"): self._reconstruct,  # numpy 1 wrote it
            ("numpy._core.multiarray", "_reconstruct"): self._reconstruct,  # numpy 2 writes it
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): self._dtype,
            ("_codecs", "encode"): self._latin1_bytes,
        }
        found = allowed.get((module, name))
        if found is None:
            raise self.refuse(f"asks for {module}.{name}"[:200])
        return found

    def _reconstruct(self, subtype: Any, _shape: Any, dtype: Any) -> np.ndarray:
        """An empty array that the pickle's BUILD fills (numpy's own order of events); its
        ``__setstate__`` checks the data's length against the shape, so memory stays bounded
        by the file's size."""
        self.arrays += 1
        if subtype is not np.ndarray or self.arrays > MAX_ARRAYS:
            raise self.refuse("builds other objects than the arrays of a batch")
        return np.ndarray.__new__(np.ndarray, (0,), self._dtype(dtype))

    def _dtype(self, spec: Any, align: bool = False, _copy: bool = True) -> np.dtype:
        if not isinstance(spec, (str, bytes)) or align not in (0, 1):
            raise self.refuse(f"describes an array type as {type(spec).__name__}")
        # Always a copy: the pickle's BUILD then sets the state of a private dtype object, never
        # of numpy's shared built-in one.
        dtype = np.dtype(spec, align=bool(align), copy=True)
        if dtype.hasobject:  # an object array would hold (and rebuild) arbitrary objects
            raise self.refuse("holds an array of Python objects")
        return dtype

    def _latin1_bytes(self, text: Any, encoding: Any = "latin1", *_: Any) -> bytes:
        if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
            raise self.refuse("encodes text in an unexpected way")
        return text.encode("latin-1")


def load(path: str | Path) -> dict[str, Any]:
    """The dict in one of CIFAR's files (a data batch or the meta file), read without running
    anything from it. Raises ``NotCifarFileError`` (an ``UnpicklingError``) for anything else,
    ``OSError`` for a missing, unreadable or non-regular file."""
    path = Path(path)
    # Followed symlinks are fine here: data directories are often links to a shared copy.
    with open_regular(path, follow_symlinks=True) as fh:
        unpickler = _CifarUnpickler(fh, path)
        try:
            entry = unpickler.load()
        except NotCifarFileError:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError) as err:
            raise NotCifarFileError(f"{path} is not a CIFAR batch: {err}"[:500]) from None
    if not isinstance(entry, dict):
        raise NotCifarFileError(f"{path} is not a CIFAR batch: it holds a {type(entry).__name__}")
    return entry


def batch_arrays(
    entry: dict[str, Any], path: Path, label_keys: tuple[str, ...]
) -> tuple[np.ndarray, np.ndarray]:
    """(uint8 pixels (N, 3072), int64 labels (N,)) of a loaded batch, checked."""
    data = entry.get("data")
    key = next((k for k in label_keys if k in entry), None)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2:
        raise NotCifarFileError(f"{path} is not a CIFAR batch: no uint8 'data' array (N, 3072)")
    if data.shape[1] != 3072 or key is None:
        labels = " or ".join(repr(k) for k in label_keys)
        raise NotCifarFileError(
            f"{path} is not a CIFAR batch: data is {data.shape}, not (N, 3072), or no {labels}"
        )
    try:
        labels = np.asarray(entry[key], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise NotCifarFileError(f"{path} is not a CIFAR batch: {key!r} is not integers") from None
    if labels.shape != (len(data),):
        raise NotCifarFileError(
            f"{path} is not a CIFAR batch: {labels.shape} labels for {len(data)} images"
        )
    return data, labels
