"""Find the newest checkpoint that verifies, load it safely, and say why others were skipped.

Order of trust: ``latest`` names the committed checkpoint; if it fails verification, older
ones are tried newest first; if the pointer itself is missing or garbage, every step directory
is a candidate. Directories newer than the pointer were never committed and are ignored.
Checkpoints that exist but all fail raise: silently training from scratch would hide the loss.
"""

from __future__ import annotations

import os
import pickle
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import committed
from .comm import Agreement, dist_ready, dist_same_int
from .errors import CheckpointCorruptError, CheckpointError, CheckpointMismatchError
from .manifest import (
    SHARDED_DIR,
    SHARED_FILE,
    VerifyFailure,
    open_verified,
    parse_step,
    rank_file,
    read_manifest,
    step_dirs,
)

Log = Callable[[str], None]
# Where a sharded checkpoint's state is read: the live state's dict, or what makes it when
# there is one to read (making it may change the live state: Resumable._restore).
ShardedInto = dict[str, Any] | Callable[[], dict[str, Any]] | None


@dataclass
class Loaded:
    """A verified checkpoint as seen by one rank."""

    shared: dict[str, Any]
    per_rank: dict[str, Any] | None  # None when this rank did not exist in the saved world
    manifest: dict[str, Any]
    path: Path
    # A sharded checkpoint's dcp/ directory (its state was read into load_latest's
    # sharded_into; ``shared`` is then empty), None for the torch payload.
    sharded: Path | None = None

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def world_size(self) -> int:
        """The world size that saved it: the trainer compares it with its own to refuse or
        re-shard (per-rank RNG states only exist for the saved ranks)."""
        return int(self.manifest["world_size"])

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.manifest.get("meta") or {})


def candidates(root: Path, log: Log) -> list[Path]:
    """Directories to try, best first, with a log line for every one skipped up front."""
    dirs = step_dirs(root)
    name, problem = committed.read_latest(root)
    if problem:
        log(f"checkpoint: {problem}; trying every step directory, newest first")
        return [path for _, path in dirs]
    if name is None:
        if dirs:
            log("checkpoint: no 'latest' pointer; trying every step directory, newest first")
        return [path for _, path in dirs]
    pointed = parse_step(name)
    assert pointed is not None  # read_latest validated the name
    if not (root / name).is_dir():
        log(f"checkpoint: 'latest' names {name}, which does not exist; trying older ones")
    for step, path in dirs:
        if step > pointed:
            log(f"checkpoint: ignoring {path.name}: newer than 'latest' ({name}), never committed")
    return [path for step, path in dirs if step <= pointed]


def _check_expect(manifest: dict[str, Any], path: Path, expect: dict[str, Any]) -> None:
    found = dict(manifest.get("meta") or {})
    found["world_size"] = manifest["world_size"]
    for key, want in expect.items():
        have = found.get(key)
        if have != want:
            what = "world size" if key == "world_size" else f"meta[{key!r}]"
            raise CheckpointMismatchError(
                f"checkpoint {path} has {what} = {have!r}, but this run expects {want!r}",
                hint="point the run at its own directory, or start a fresh one; for a world "
                "size change, load without expect={'world_size': ...} and re-shard",
            )


def _load_verified(path: Path, manifest: dict[str, Any], name: str, map_location: Any) -> Any:
    """Check one file against the manifest, then unpickle the same open file as plain data."""
    with open_verified(path, name, manifest["files"][name]) as f:
        try:
            return torch.load(f, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise VerifyFailure(path, f"{name} refused by weights_only=True ({first})") from None


def _verify_sharded(path: Path, manifest: dict[str, Any], rank: int, world_size: int) -> Path:
    """Check this rank's share of a sharded checkpoint's files against the manifest (each file
    is hashed by one rank of the loading world); DCP reads them after every rank agreed."""
    from .sharded import files_to_verify

    root = path / SHARDED_DIR
    try:
        st = os.lstat(root)
    except OSError as exc:
        raise VerifyFailure(path, f"cannot read {SHARDED_DIR}/: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):  # a symlink there would send DCP's reads elsewhere
        raise VerifyFailure(path, f"{SHARDED_DIR} is not a directory")
    for name in files_to_verify(manifest["files"], rank, world_size):
        open_verified(path, name, manifest["files"][name]).close()
    return root


def _try_one(
    path: Path, rank: int, world_size: int, map_location: Any, expect: dict[str, Any] | None
) -> Loaded:
    """Verify what this rank reads (manifest, shared file, its own file) and load it.

    Each rank checks only the files it reads: with thousands of ranks, each re-reading every
    rank's file would be N^2 reads on the shared file system.
    """
    manifest = read_manifest(path)
    if expect:  # before the files: the manifest is the same for all ranks, so is the verdict
        _check_expect(manifest, path, expect)
    sharded = None
    if manifest.get("payload") == "dcp":
        sharded, shared = _verify_sharded(path, manifest, rank, world_size), {}
    else:
        shared = _load_verified(path, manifest, SHARED_FILE, map_location)
    own = rank_file(rank) if rank < manifest["world_size"] else None
    per_rank = _load_verified(path, manifest, own, map_location) if own else None
    return Loaded(shared=shared, per_rank=per_rank, manifest=manifest, path=path, sharded=sharded)


def _read_sharded(loaded: Loaded, into: ShardedInto, agree: Agreement) -> tuple[bool, str]:
    """Read a verified sharded checkpoint into ``into`` on every rank: (all ranks did, why not).
    DCP's load is collective and raises on every rank when one fails, so all move on together."""
    if loaded.sharded is None:
        return True, ""
    reason = ""
    if callable(into):  # made now that there is a sharded checkpoint to read
        into = into()
    try:
        if into is None:
            raise CheckpointError(
                f"{loaded.path} is a sharded checkpoint: its state is read into the live one",
                hint="pass sharded_into= (e.g. get_state_dict(model, optimizer)) to load_latest",
            )
        from .sharded import ShardReadError, load

        try:
            load(loaded.sharded, into)
        except ShardReadError as exc:  # a file changed since it was hashed, a foreign layout
            reason = f"{loaded.path.name}: reading its shards failed ({exc.message})"
    except CheckpointError:
        raise
    all_ok, who = agree(not reason)
    return all_ok, reason or f"{loaded.path.name}: {who} could not read its shards"


def _choose(
    root: Path,
    rank: int,
    map_location: Any,
    expect: dict[str, Any] | None,
    agree: Agreement,
    log: Log,
    world_size: int = 1,
    sharded_into: ShardedInto = None,
) -> Loaded | None:
    """Walk the candidates together: a checkpoint is used only if every rank could use it.

    Two agreements per candidate: first whether any rank hit a fatal error (a mismatch: raise
    everywhere), then whether every rank verified and loaded its part (else all move on).
    """
    failures: list[str] = []
    for path in candidates(root, log):
        loaded: Loaded | None = None
        fatal: BaseException | None = None
        reason = ""
        try:
            loaded = _try_one(path, rank, world_size, map_location, expect)
        except VerifyFailure as failure:
            reason = str(failure)
        except Exception as exc:  # raised after the agreement so peers do not wait on us
            fatal = exc
        no_fatal, who = agree(fatal is None)
        if fatal is not None:
            raise fatal
        if not no_fatal:
            raise CheckpointError(f"{who} refused {path}; see its log")
        all_ok, who = agree(loaded is not None)
        if all_ok:
            assert loaded is not None
            all_ok, reason = _read_sharded(loaded, sharded_into, agree)
        if all_ok:
            if failures:
                log(f"checkpoint: fell back to {path.name} after {len(failures)} unusable one(s)")
            assert loaded is not None
            return loaded
        reason = reason or f"{path.name}: {who} could not verify or load its part"
        failures.append(reason)
        log(f"checkpoint: skipping {reason}")
    if failures:
        raise CheckpointCorruptError(
            f"no usable checkpoint in {root}: {'; '.join(failures)}",
            hint="restore the directory from a backup, or move it aside to start from scratch "
            "deliberately (refusing to silently discard the run's progress)",
        )
    return None


def load_latest(
    root: Path,
    *,
    rank: int,
    world_size: int,
    map_location: Any,
    expect: dict[str, Any] | None,
    agree: Agreement,
    log: Log,
    sharded_into: ShardedInto = None,
) -> Loaded | None:
    """Load on every rank; all ranks must end on the same checkpoint or all raise."""
    if rank == 0 and root.is_dir():
        committed.clean_leftovers(root, log)
    loaded = (
        _choose(root, rank, map_location, expect, agree, log, world_size, sharded_into)
        if root.is_dir()
        else None
    )
    step = loaded.step if loaded else -1
    if world_size > 1 and dist_ready(world_size) and not dist_same_int(step):
        # Only possible when nodes see different file-system states (a non-shared run dir,
        # or NFS attribute caching): training on from different steps would silently diverge.
        raise CheckpointError(
            f"ranks chose different checkpoints (this rank: step {step})",
            hint="the run directory must be one shared file system seen identically by all nodes",
        )
    if loaded and loaded.world_size != world_size:
        log(
            f"checkpoint: {loaded.path.name} was saved by {loaded.world_size} ranks, this run "
            f"has {world_size}; per-rank state exists only for ranks < {loaded.world_size}"
        )
    return loaded
