"""The sharded payload: a checkpoint's ``shared`` state written by ``torch.distributed.checkpoint``.

A model sharded with FSDP2 (``fully_shard``) holds DTensors: no rank has the whole state, so
rank 0 cannot write a ``shared.pt``. Here every rank writes its own shards into the checkpoint's
``dcp/`` directory through DCP (``__R_0.distcp`` per rank, ``.metadata`` by rank 0), inside the
unchanged commit protocol: the files land in ``.tmp-step-N/dcp``, each rank hashes the files it
wrote, rank 0 puts every digest into the manifest, and only the ``latest`` move commits them.
Loading verifies the files (each rank a share of them) before DCP reads them into the live,
sharded state; DCP reshards, so the world size may differ from the saver's.

DCP's own reader unpickles ``.metadata`` with plain ``pickle`` and non-tensor values with
``torch.load(weights_only=False)``: both are replaced here (:class:`SafeReader`,
:class:`SafePlanner`), so a checkpoint stays data, never code.
"""

from __future__ import annotations

import pickle
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from .errors import CheckpointError, CheckpointWriteError
from .fsutil import fsync_dir, raising_io, sha256_file
from .manifest import SHARDED_DIR

METADATA = ".metadata"


@contextmanager
def _one_process_quietly() -> Iterator[None]:
    """Without a process group DCP warns at every call that it assumes one process: that is
    what a world of one is."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def has_dtensors(obj: Any) -> bool:
    """True if a DTensor is anywhere in ``obj`` (nested dicts, lists, tuples)."""
    if isinstance(obj, DTensor):
        return True
    if isinstance(obj, Mapping):
        return any(has_dtensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(has_dtensors(v) for v in obj)
    return False


# --------------------------------------------------------------------------------- async copy
def split(obj: Any) -> tuple[Any, dict[tuple[Any, ...], Any]]:
    """``obj`` with every DTensor replaced by its local shard (a plain tensor, which the
    asynchronous snapshot copies in stream order like any other), and the DTensors' specs by
    their position, for :func:`join` to rebuild them around the copies."""
    specs: dict[tuple[Any, ...], Any] = {}

    def walk(value: Any, where: tuple[Any, ...]) -> Any:
        if isinstance(value, DTensor):
            specs[where] = value._spec
            return value.to_local()
        if type(value) in (dict, OrderedDict):
            return type(value)((k, walk(v, (*where, k))) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(walk(v, (*where, i)) for i, v in enumerate(value))
        return value

    return walk(obj, ()), specs


def join(obj: Any, specs: dict[tuple[Any, ...], Any]) -> Any:
    """The inverse of :func:`split`: each local copy wrapped as a DTensor of its spec again.
    DCP only reads the spec (mesh coordinates, placements, global shape), never the device."""

    def walk(value: Any, where: tuple[Any, ...]) -> Any:
        if where in specs:
            return DTensor(value, specs[where], requires_grad=False)
        if isinstance(value, Mapping):
            return type(value)((k, walk(v, (*where, k))) for k, v in value.items())
        if type(value) in (list, tuple):
            return type(value)(walk(v, (*where, i)) for i, v in enumerate(value))
        return value

    return walk(obj, ()) if specs else obj


# ---------------------------------------------------------------------------------------- save
def write(
    root: Path, state: dict[str, Any], rank: int, group: dist.ProcessGroup | None
) -> dict[str, tuple[int, str]]:
    """Write this rank's shards of ``state`` into ``root`` (every rank calls it: DCP plans the
    save collectively over ``group``), fsync them, and return (size, sha256) of the files this
    rank wrote, named as in the manifest (``dcp/__R_0.distcp``; rank 0 also ``dcp/.metadata``).
    """
    writer = FileSystemWriter(root, single_file_per_rank=True, sync_files=True, thread_count=1)
    try:
        with _one_process_quietly():
            dcp.save(state, storage_writer=writer, process_group=group)
    except CheckpointException as exc:  # a BaseException: it would skip the agreements
        raise CheckpointWriteError(
            f"could not write the shards into {root}: {first_failure(exc)}",
            hint="the failing rank's error is quoted; the previous checkpoint is intact",
        ) from None
    with raising_io("fsync", root):
        fsync_dir(root)
    mine = sorted(p for p in root.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(root / METADATA)
    out = {}
    for path in mine:
        with raising_io("read back", path):
            out[f"{SHARDED_DIR}/{path.name}"] = sha256_file(path)
    return out


def gather_digests(
    own: dict[str, tuple[int, str]], world_size: int, group: dist.ProcessGroup | None
) -> dict[str, tuple[int, str]]:
    """Every rank's file digests, on every rank (rank 0 puts them into the manifest)."""
    if world_size == 1:
        return dict(own)
    parts: list[Any] = [None] * world_size
    dist.all_gather_object(parts, own, group=group)
    merged: dict[str, tuple[int, str]] = {}
    for part in parts:
        merged.update(part)
    return merged


# ---------------------------------------------------------------------------------------- load
def files_to_verify(files: Mapping[str, Any], rank: int, world_size: int) -> list[str]:
    """This rank's share of the sharded files: each file is hashed by one rank of the loading
    world, never by all of them."""
    names = sorted(name for name in files if name.startswith(f"{SHARDED_DIR}/"))
    return names[rank::world_size]


# What DCP's .metadata pickles: its own plain dataclasses, torch.Size, dtypes and a path.
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "Path"),
    ("pathlib._local", "PosixPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Checked by name before anything is imported: importing a module runs its code.
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


class SafeReader(FileSystemReader):
    """DCP's file-system reader, with ``.metadata`` unpickled only into DCP's metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{METADATA} holds a {type(metadata).__name__}")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values (optimizer hyper-parameters, counters) read by
    ``torch.load(weights_only=True)`` instead of unpickling arbitrary objects."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class ShardReadError(CheckpointError):
    """DCP could not read a verified sharded checkpoint into the live state (the loader then
    falls back to an older one)."""


def first_failure(exc: CheckpointException) -> str:
    """The first failing rank's error in one line: DCP's own message holds whole tracebacks."""
    for rank, wrapped in sorted(exc.failures.items()):
        failure = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (error, traceback)
        text = str(failure).strip().splitlines()
        return f"rank {rank}: {type(failure).__name__}: {text[-1] if text else ''}"[:400]
    return str(exc)[:400]


def load(root: Path, target: dict[str, Any], group: dist.ProcessGroup | None = None) -> None:
    """Read the checkpoint in ``root`` into ``target`` in place (every rank: DCP plans the load
    collectively, and reshards to ``target``'s DTensors, whatever world wrote them)."""
    try:
        with _one_process_quietly():
            dcp.load(
                target, storage_reader=SafeReader(root), planner=SafePlanner(), process_group=group
            )
    except CheckpointException as exc:  # a BaseException: it would skip the agreements
        raise ShardReadError(first_failure(exc)) from None
