"""One run per run directory: a non-blocking file lock held for the run's lifetime.

Two jobs resuming from and saving into one directory would interleave checkpoints and prune
each other's. The lock is an OS lock (flock via filelock), so it vanishes with its holder,
even after kill -9: there is no stale lock to clean by hand. Who holds it is written to a
separate file, because filelock truncates the lock file on every attempt to take it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

import filelock

from .errors import RunDirLockedError
from .fsutil import raising_io

LOCK_FILE = ".run.lock"
OWNER_FILE = ".run.lock.owner"


class RunDirLock:
    """Hold ``root`` for this process. Take it on one rank per job (rank 0), not on every rank.

    Needs a file system with working flock across nodes (local disks, NFSv4; Lustre mounted
    with ``-o flock``) to protect against a second job on another node.
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._lock = filelock.FileLock(str(self.root / LOCK_FILE), timeout=0)

    def acquire(self) -> RunDirLock:
        with raising_io("create the run directory", self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=0)
        except filelock.Timeout:
            raise RunDirLockedError(
                f"run directory {self.root} is in use by {self._holder()}",
                hint="wait for that run to finish, stop it, or give this run another directory",
            ) from None
        owner = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "argv": sys.argv,
            "job_id": os.environ.get("SLURM_JOB_ID"),
        }
        with raising_io("write", self.root / OWNER_FILE):
            (self.root / OWNER_FILE).write_text(json.dumps(owner) + "\n")
        return self

    def _holder(self) -> str:
        try:
            owner = json.loads((self.root / OWNER_FILE).read_text())
        except (OSError, ValueError):
            return "another process (owner unknown: no readable owner file)"
        job = f", Slurm job {owner['job_id']}" if owner.get("job_id") else ""
        return f"pid {owner.get('pid')} on host {owner.get('host')}{job} since {owner.get('since')}"

    def release(self) -> None:
        if self._lock.is_locked:
            # The lock itself is what matters; the owner file is informational.
            with contextlib.suppress(OSError):
                (self.root / OWNER_FILE).unlink()
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
