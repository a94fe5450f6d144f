"""Names inside a run directory, and the manifest that makes a checkpoint self-verifying.

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
from typing import Any

import torch

import hpc_ddp

from .errors import CheckpointError
from .fsutil import sha256_file

FORMAT = "hpc-ddp-checkpoint/1"
MANIFEST = "manifest.json"
SHARED_FILE = "shared.pt"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"
STEP_RE = re.compile(r"^step-(\d{8,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def tmp_dir_name(step: int) -> str:
    # The same name on every rank, derived from the step alone: no communication needed to
    # agree where to write.
    return f"{TMP_PREFIX}{step_dir_name(step)}"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def parse_step(name: str) -> int | None:
    m = STEP_RE.match(name)
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
    step: int, world_size: int, meta: dict[str, Any], files: dict[str, tuple[int, str]]
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
    """The manifest, if it parses, self-verifies and lists every file a checkpoint needs."""
    try:
        raw = (path / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise VerifyFailure(path, f"no {MANIFEST} (the save never finished)") from None
    except OSError as exc:
        raise VerifyFailure(path, f"cannot read {MANIFEST}: {exc.strerror}") from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise VerifyFailure(path, f"{MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise VerifyFailure(path, f"{MANIFEST} is not an {FORMAT} manifest")
    if manifest.get("manifest_sha256") != _self_hash(manifest):
        raise VerifyFailure(path, f"{MANIFEST} fails its own checksum (edited or bit-flipped)")
    if manifest.get("step") != parse_step(path.name):
        raise VerifyFailure(path, f"manifest says step {manifest.get('step')}, dir says otherwise")
    files: dict[str, dict[str, Any]] = manifest["files"]
    expected = {SHARED_FILE} | {rank_file(r) for r in range(int(manifest["world_size"]))}
    if missing := sorted(expected - files.keys()):
        raise VerifyFailure(path, f"manifest lists no {', '.join(missing)}")
    return manifest


def verify_files(path: Path, manifest: dict[str, Any], only: set[str] | None = None) -> None:
    """Check sizes and sha256 against the manifest.

    ``only`` limits the byte-for-byte check to the files one rank will read: with thousands of
    ranks, each re-reading every rank's file would be N^2 reads on the shared file system.
    """
    for name, entry in manifest["files"].items():
        if only is not None and name not in only:
            continue
        fpath = path / name
        try:
            size, digest = sha256_file(fpath)
        except FileNotFoundError:
            raise VerifyFailure(path, f"{name} is missing") from None
        except OSError as exc:
            raise VerifyFailure(path, f"cannot read {name}: {exc.strerror}") from None
        if size != entry["size"]:
            raise VerifyFailure(
                path, f"{name} has {size} bytes, manifest says {entry['size']} (truncated?)"
            )
        if digest != entry["sha256"]:
            raise VerifyFailure(path, f"{name} sha256 {digest[:12]}... != manifest's")
