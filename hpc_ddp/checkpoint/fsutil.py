"""Durable file-system primitives: fsynced writes, directory fsync, hashing, clear I/O errors.

A checkpoint is only as good as the last fsync: a rename is durable only once the directory
that holds it is fsynced, and a file's bytes only once the file itself is. Every helper here
raises :class:`CheckpointWriteError` naming the path and the free space, because "OSError: [Errno
28]" alone tells a user nothing about which file system filled up.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import BinaryIO

from hpc_ddp.regular_file import open_regular

from .errors import CheckpointWriteError

CHUNK = 4 << 20  # 4 MiB: big enough for throughput, small enough not to matter for memory


def free_space(path: Path) -> str:
    """Human-readable free space of the file system holding ``path`` (or its nearest parent)."""
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        usage = shutil.disk_usage(p)
    except OSError as exc:  # the file system itself may be gone; say so instead of failing again
        return f"unknown ({exc.strerror})"
    return f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"


def io_error(
    action: str, path: Path, exc: BaseException, *, written: int | None = None
) -> CheckpointWriteError:
    """Wrap an OSError into an actionable error: which path, which errno, how much space is left."""
    if not isinstance(exc, OSError):
        return CheckpointWriteError(f"could not {action} {path}: {exc}")
    hint = "check permissions and that the file system is mounted and writable"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        hint = (
            "free space on that file system (or raise the quota/file-size limit), lower "
            "keep=, or point the run directory at a larger file system"
        )
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        hint = "make the run directory writable by this user, or choose another run directory"
    return CheckpointWriteError(
        f"could not {action} {path}: [{errno.errorcode.get(exc.errno or 0, exc.errno)}] "
        f"{exc.strerror or exc}"
        + (f" after {written / 2**20:.1f} MiB" if written else "")
        + f"; {free_space(path)}",
        hint=f"{hint}. The previous checkpoint, if any, is untouched.",
    )


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (creations, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some network file systems refuse fsync on a directory; their renames are synchronous
        # on the server anyway, so there is nothing more we could do.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


class HashingWriter:
    """A write-only file object that hashes and counts every byte on its way to disk.

    ``torch.save`` streams into it, so the checksum costs no second read and no second copy of
    the state in memory.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._h = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            n = self._f.write(data)
        except OSError as exc:
            # torch.save's C++ writer swallows exceptions from write() and later fails with
            # "unexpected pos"; remember the real cause (ENOSPC, EFBIG, EIO) to report it.
            self.error = self.error or exc
            raise
        self._h.update(data)
        self.size += len(data)
        return n

    def flush(self) -> None:
        self._f.flush()

    @property
    def sha256(self) -> str:
        return self._h.hexdigest()


def write_durably(
    path: Path, produce: Callable[[HashingWriter], None], *, fsync_parent: bool = True
) -> tuple[int, str]:
    """Write ``path`` through a temporary name: produce -> flush -> fsync -> rename.

    Returns (size, sha256) of what was written. On any error the temporary file is removed and
    ``path`` is left as it was, so readers never see half a file under the final name.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w: HashingWriter | None = None
    try:
        with open(tmp, "wb") as f:
            w = HashingWriter(f)
            produce(w)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync_parent:
            fsync_dir(path.parent)
    except BaseException as exc:
        cause = w.error if w is not None and w.error is not None else exc
        # Measure the free space before removing the partial file: that is what the user
        # needs to see (a file system at 0 bytes free, not the space our cleanup gave back).
        error = io_error("write", path, cause, written=w.size if w else 0)
        _unlink_quietly(tmp)
        if isinstance(cause, OSError):
            raise error from exc
        raise
    return w.size, w.sha256


def write_bytes_durably(path: Path, data: bytes) -> tuple[int, str]:
    return write_durably(path, lambda w: w.write(data))


def sha256_file(path: Path) -> tuple[int, str]:
    """(size, sha256) of a regular file (never a FIFO or a device: those would block or never
    end), read in chunks so a multi-GB file never sits in memory."""
    with open_regular(path) as f:
        return sha256_stream(f)


def sha256_stream(f: BinaryIO, limit: int | None = None) -> tuple[int, str]:
    """(size, sha256) of what is left in ``f``; stops after ``limit`` bytes plus one chunk, so a
    file that keeps growing cannot keep the reader busy (the size then exceeds ``limit``)."""
    h = hashlib.sha256()
    size = 0
    for chunk in iter(lambda: f.read(CHUNK), b""):
        h.update(chunk)
        size += len(chunk)
        if limit is not None and size > limit:
            break
    return size, h.hexdigest()


def _unlink_quietly(path: Path) -> None:
    with suppress(OSError):
        os.unlink(path)


def remove_tree(path: Path, log: Callable[[str], None] | None = None) -> bool:
    """Best-effort recursive delete; failures are logged, never raised (cleanup must not mask
    the error that made it necessary)."""
    errors: list[str] = []

    def onerror(_func: object, p: str, exc_info: object) -> None:
        errors.append(p)

    shutil.rmtree(path, onerror=onerror)  # onexc only exists on 3.12+
    if errors and log is not None:
        log(f"checkpoint: could not fully remove {path} ({len(errors)} entries left)")
    return not errors


@contextmanager
def raising_io(action: str, path: Path) -> Iterator[None]:
    """Turn a bare OSError inside the block into an actionable CheckpointWriteError."""
    try:
        yield
    except OSError as exc:
        raise io_error(action, path, exc) from exc
