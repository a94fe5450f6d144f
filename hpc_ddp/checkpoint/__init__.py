"""Atomic, verified, barrier-safe checkpoints for DDP jobs. See docs/checkpoints.md.

The run directory's lock is exported here too, as the checkpoints' users take it beside them
(it lives with the run directory, ``hpc_ddp.run_dir``)."""

from hpc_ddp.run_dir import RunDirLock, RunDirLockedError, RunDirUnwritableError

from .checkpointer import Checkpointer, Staged
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWriteError,
    UnsafeCheckpointContentError,
)
from .loader import Loaded

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "Checkpointer",
    "Loaded",
    "RunDirLock",
    "RunDirLockedError",
    "RunDirUnwritableError",
    "Staged",
    "UnsafeCheckpointContentError",
]
