"""One run per run directory: a non-blocking file lock held for the run's lifetime.

Two jobs resuming from and saving into one directory would interleave checkpoints and prune
each other's. The lock is an OS lock (flock via filelock), so it vanishes with its holder,
even after kill -9: there is no stale lock to clean by hand. Who holds it is written to a
separate file, because filelock truncates the lock file on every attempt to take it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

import filelock

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.private_paths import replace_file
from hpc_ddp.regular_file import read_json, read_small

from .paths import LOCK, LOCK_OWNER, RunPaths

OWNER_MAX_BYTES = 64 << 10  # pid, host, time, argv, job id
_OWNER_KEYS = frozenset({"pid", "host", "since"})  # in every owner file acquire() wrote


class RunDirLockedError(HpcDdpError):
    """Another process holds the run directory."""


class RunDirUnwritableError(HpcDdpError):
    """The run directory cannot be written (permissions, a read-only file system)."""


def unwritable(root: Path, path: Path, exc: OSError) -> RunDirUnwritableError:
    """The run directory cannot hold this run's files (lock, checkpoints, results)."""
    why = {
        errno.EACCES: f"not writable by this user (uid {os.getuid()})",
        errno.EPERM: f"not writable by this user (uid {os.getuid()})",
        errno.EROFS: "on a read-only file system",
    }.get(exc.errno or 0, f"unusable ({exc.strerror or exc})")
    return RunDirUnwritableError(
        f"run directory {root} is {why}: cannot create {path.name} there",
        hint="make it writable by this user (chown/chmod, or a writable mount), or give this "
        "run another run directory (--run-dir): a run writes its lock, checkpoints and results "
        "there",
    )


def is_lock_leftover(path: Path) -> bool:
    """Whether ``path`` is what a ``RunDirLock`` leaves behind: its lock file (regular, empty)
    or its owner file (the JSON it writes). Anything else, by those names or others, is not."""
    if path.name == LOCK:
        try:
            return read_small(path, 0) == b""  # regular files only, never through a link
        except OSError:
            return False
    owner = read_owner(path) if path.name == LOCK_OWNER else None
    return owner is not None and owner.keys() >= _OWNER_KEYS


def read_owner(path: Path) -> dict | None:
    """The owner JSON a ``RunDirLock`` wrote at ``path``, or None for anything else."""
    try:
        owner = read_json(path, OWNER_MAX_BYTES)
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


class RunDirLock:
    """Hold ``root`` for this process. Take it on one rank per job (rank 0), not on every rank.

    Needs a file system with working flock across nodes (local disks, NFSv4; Lustre mounted
    with ``-o flock``) to protect against a second job on another node.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.paths = RunPaths(root)
        self.root = self.paths.root
        self._lock = filelock.FileLock(str(self.paths.lock), timeout=0)

    def acquire(self) -> RunDirLock:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunDirUnwritableError(
                f"cannot create the run directory {self.root}: {exc.strerror or exc}",
                hint="create it writable by this user, or give this run another run directory "
                "(--run-dir)",
            ) from None
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise RunDirLockedError(
                f"run directory {self.root} is in use by {self._holder()}",
                hint="wait for that run to finish, stop it, or give this run another directory",
            ) from None
        except OSError as exc:  # read-only directory or file system, a planted non-file
            raise unwritable(self.root, self.paths.lock, exc) from None
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv,
            "job_id": os.environ.get("SLURM_JOB_ID"),
        }
        try:
            # Replaced, not written in place: a symlink planted under this name is swapped out,
            # never followed into a file this toolkit did not write. Informational, so not
            # fsynced: the lock itself is the OS's.
            replace_file(self.paths.lock_owner, (json.dumps(owner) + "\n").encode())
        except BaseException as exc:
            self._lock.release()
            if isinstance(exc, OSError):
                raise unwritable(self.root, self.paths.lock_owner, exc) from None
            raise
        return self

    def _holder(self) -> str:
        owner = read_owner(self.paths.lock_owner)
        if owner is None:
            return "another process (owner unknown: no readable owner file)"
        job = f", Slurm job {owner['job_id']}" if owner.get("job_id") else ""
        return f"pid {owner.get('pid')} on host {owner.get('host')}{job} since {owner.get('since')}"

    def release(self) -> None:
        if self._lock.is_locked:
            # The lock itself is what matters; the owner file is informational.
            with contextlib.suppress(OSError):
                self.paths.lock_owner.unlink()
            self._lock.release()

    @property
    def held(self) -> bool:
        return self._lock.is_locked

    def __enter__(self) -> RunDirLock:
        return self.acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()
