"""Names inside a checkpoint directory (the run dir's are hpc_ddp.run_dir.paths'), and the
manifest that makes a checkpoint self-verifying.

``manifest.json`` is written last, after every payload file is on disk and hashed, and it
carries its own checksum: a directory whose manifest parses, self-verifies and matches every
file byte for byte is a complete checkpoint, whatever happened around it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

import hpc_ddp
from hpc_ddp.regular_file import open_regular, read_small
from hpc_ddp.run_dir.paths import MANIFEST, STEP_PREFIX, step_dir_name

from .errors import CheckpointError
from .fsutil import sha256_stream

FORMAT = "hpc-ddp-checkpoint/1"
SHARED_FILE = "shared.pt"
# The payload formats: "torch" (shared.pt by rank 0; manifests without the field) and "dcp"
# (the shared state's shards, written by every rank through torch.distributed.checkpoint).
PAYLOADS = ("torch", "dcp")
SHARDED_DIR = "dcp"
# DCP's file names: one per rank and writer thread, and the metadata.
SHARDED_FILE_RE = re.compile(rf"{SHARDED_DIR}/(\.metadata|__[0-9]{{1,7}}_[0-9]{{1,3}}\.distcp)")
MAX_SHARDED_FILES_PER_RANK = 64
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
# ASCII digits only (\d also matches other scripts' digits, which int() accepts), and at most 19:
# every step fits in 64 bits, and no directory name can make int() work on thousands of digits.
STEP_RE = re.compile(rf"{STEP_PREFIX}([0-9]{{8,19}})")
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# A manifest holds about 140 bytes per rank: 16 MiB is room for 100,000 ranks, and the most a
# reader parses before it knows whether the manifest verifies.
MAX_MANIFEST_BYTES = 16 << 20


def tmp_dir_name(step: int) -> str:
    # The same name on every rank, derived from the step alone: no communication needed to
    # agree where to write.
    return f"{TMP_PREFIX}{step_dir_name(step)}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def parse_step(name: str) -> int | None:
    m = STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Committed-looking step directories, newest first."""
    found = []
    for entry in os.scandir(root):
        step = parse_step(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            found.append((step, Path(entry.path)))
    return sorted(found, reverse=True)


def _self_hash(manifest: dict[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def check_meta(meta: dict[str, Any]) -> None:
    """meta lands in JSON: refuse at save time what JSON cannot hold, naming the key."""
    try:
        json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint meta is not JSON-serialisable: {exc}",
            hint="meta holds small descriptive values (str, int, float, bool, lists, dicts); "
            "put tensors and state into shared= or per_rank=",
        ) from exc


def build_manifest(
    step: int,
    world_size: int,
    meta: dict[str, Any],
    files: dict[str, tuple[int, str]],
    payload: str = "torch",
) -> dict[str, Any]:
    now = time.time()
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "step": step,
        "epoch": meta.get("epoch"),
        "world_size": world_size,
        "meta": meta,
        "files": {name: {"size": s, "sha256": h} for name, (s, h) in sorted(files.items())},
        "versions": {
            "torch": torch.__version__,
            "python": platform.python_version(),
            "hpc_ddp": hpc_ddp.__version__,
        },
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "created_unix": now,
        "host": socket.gethostname(),
    }
    if payload != "torch":  # absent for the original format: older readers still verify it
        manifest["payload"] = payload
    manifest["manifest_sha256"] = _self_hash(manifest)
    return manifest


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


@dataclass
class VerifyFailure(Exception):
    """Why one directory is not a usable checkpoint (internal: drives the fallback)."""

    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path.name}: {self.reason}"


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest, if it parses, self-verifies, follows the schema and lists every file a
    checkpoint needs. Anything else is a :class:`VerifyFailure`: the loader falls back."""
    try:
        raw = read_small(path / MANIFEST, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise VerifyFailure(path, f"no {MANIFEST} (the save never finished)") from None
    except OSError as exc:
        raise VerifyFailure(path, f"cannot read {MANIFEST}: {exc.strerror}") from None
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # RecursionError: absurdly deep nesting
        raise VerifyFailure(path, f"{MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VerifyFailure(path, f"{MANIFEST} is not an {FORMAT} manifest")
    if manifest.get("manifest_sha256") != _self_hash(manifest):
        raise VerifyFailure(path, f"{MANIFEST} fails its own checksum (edited or bit-flipped)")
    # The checksum only proves the manifest is as someone wrote it: check every field used.
    if problem := schema_problem(manifest, parse_step(path.name)):
        raise VerifyFailure(path, f"{MANIFEST} does not verify: {problem}")
    return manifest


def _is_int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def schema_problem(manifest: dict[str, Any], dir_step: int | None) -> str | None:
    """Why ``manifest`` is not one this code could have written for step ``dir_step``, or None."""
    step, world, files = manifest.get("step"), manifest.get("world_size"), manifest.get("files")
    if not _is_int(step, 0):
        return f"step is {step!r}, not an integer >= 0"
    if step != dir_step:
        return f"it says step {step}, the directory name says otherwise"
    if not _is_int(world, 1):
        return f"world_size is {world!r}, not an integer >= 1"
    if not isinstance(manifest.get("meta"), dict):
        return "meta is not a JSON object"
    if not isinstance(files, dict):
        return "files is not a JSON object"
    payload = manifest.get("payload", "torch")
    if payload not in PAYLOADS:
        return f"payload is {payload!r}, not one of {', '.join(PAYLOADS)}"
    if problem := (_sharded_files_problem if payload == "dcp" else _files_problem)(files, world):
        return problem
    for name, entry in files.items():
        if not isinstance(entry, dict) or not _is_int(entry.get("size"), 0):
            return f"files[{name!r}] has no integer size >= 0"
        if not (isinstance(entry.get("sha256"), str) and SHA256_RE.fullmatch(entry["sha256"])):
            return f"files[{name!r}] has no sha256 of 64 hex digits"
    return None


def _files_problem(files: dict[str, Any], world: int) -> str | None:
    # Counting first keeps the expected-name set as small as the file that was read.
    if len(files) != world + 1:
        return f"it lists {len(files)} files for a world of {world} ranks (expected {world + 1})"
    expected = {SHARED_FILE} | {rank_file(r) for r in range(world)}
    if missing := sorted(expected - files.keys()):
        return f"it lists no {', '.join(missing[:3])}"  # so names are only the expected ones
    return None


def _sharded_files_problem(files: dict[str, Any], world: int) -> str | None:
    most = world + 1 + world * MAX_SHARDED_FILES_PER_RANK
    if not world + 1 < len(files) <= most:
        return f"it lists {len(files)} files for a sharded world of {world} ranks"
    ranks = {rank_file(r) for r in range(world)}
    if missing := sorted(ranks - files.keys()):
        return f"it lists no {', '.join(missing[:3])}"
    if f"{SHARDED_DIR}/.metadata" not in files:
        return f"it lists no {SHARDED_DIR}/.metadata"
    for name in files.keys() - ranks:
        if not (isinstance(name, str) and SHARDED_FILE_RE.fullmatch(name)):
            return f"it lists {str(name)[:60]!r}, not a file of a sharded checkpoint"
    return None


def open_verified(path: Path, name: str, entry: dict[str, Any]) -> BinaryIO:
    """``path/name`` opened, with its size and sha256 checked against the manifest ``entry``,
    positioned at its start: the caller reads the very bytes that were checked.

    The size is compared with the open file's before any byte is read, so a manifest or a file
    of absurd size costs nothing; a symlink, FIFO or device is refused without reading.
    """
    try:
        f = open_regular(path / name)
    except FileNotFoundError:
        raise VerifyFailure(path, f"{name} is missing") from None
    except OSError as exc:
        raise VerifyFailure(path, f"cannot read {name}: {exc.strerror}") from None
    try:
        want = entry["size"]
        size = os.fstat(f.fileno()).st_size
        if size == want:
            size, digest = sha256_stream(f, limit=want)
        if size != want:
            raise VerifyFailure(path, f"{name} has {size} bytes, manifest says {want} (truncated?)")
        if digest != entry["sha256"]:
            raise VerifyFailure(path, f"{name} sha256 {digest[:12]}... != manifest's")
        f.seek(0)
    except OSError as exc:
        f.close()
        raise VerifyFailure(path, f"cannot read {name}: {exc.strerror}") from None
    except BaseException:
        f.close()
        raise
    return f
