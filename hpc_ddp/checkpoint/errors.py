"""Checkpoint errors: each says what was found, where, and what to do (a HINT)."""

from __future__ import annotations

from hpc_ddp.errors import HpcDdpError


class CheckpointError(HpcDdpError):
    """A checkpoint could not be written or read."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (full disk, permissions, I/O). The previous one is intact."""


class CheckpointCorruptError(CheckpointError):
    """Checkpoints exist but none of them verifies: refusing to silently start from scratch."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint belongs to another model or configuration than the one being resumed."""


class UnsafeCheckpointContentError(CheckpointError):
    """Part of the state is not plain data: ``torch.load(weights_only=True)`` would refuse it."""
