"""Atomic, verified, barrier-safe checkpoints for DDP jobs. See docs/checkpoints.md."""

from .checkpointer import Checkpointer, Staged
from .errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointWriteError,
    RunDirLockedError,
    RunDirUnwritableError,
    UnsafeCheckpointContentError,
)
from .loader import Loaded
from .lock import RunDirLock

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
