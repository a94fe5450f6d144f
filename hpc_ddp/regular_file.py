"""Open files that someone else may have replaced: regular files only, reads bounded.

Run and data directories are often shared and writable by others, and a name the toolkit reads
back can be swapped for something that is not a file: a FIFO blocks ``open()`` until a writer
appears (forever, and a signal handler that only sets a flag cannot end the wait), a device such
as ``/dev/zero`` never reaches end-of-file (a whole-file read ends in MemoryError), and a symlink
can point at either. Here a file is opened with ``O_NONBLOCK`` (opening a FIFO returns at once),
its type checked on the open descriptor (no race with a later swap), and small files are read up
to a size limit. Errors are ``OSError`` subclasses, so callers' existing ``except OSError`` paths
treat a hostile file as an unreadable one.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

# The run dir's JSON records (config, progress, result, the lock's owner) hold a few KiB; the
# bound only stops a planted file from making a reader load without end.
JSON_LIMIT = 16 << 20


class NotRegularFileError(OSError):
    """The path exists but is not a regular file (a FIFO, a device, a directory, a symlink)."""


class FileTooLargeError(OSError):
    """A file that should be small is larger than its limit."""


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def open_regular(path: str | Path, *, follow_symlinks: bool = False) -> BinaryIO:
    """Open ``path`` for reading if it is a regular file; never blocks on a FIFO.

    ``follow_symlinks=False`` refuses a symlink as the last component (files the toolkit wrote
    itself are never symlinks, so one there was planted); directories above it are followed.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if not follow_symlinks:
        flags |= os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks and os.path.islink(path):
            raise NotRegularFileError(
                errno.ELOOP, "a symbolic link, not a regular file", str(path)
            ) from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFileError(errno.EINVAL, f"{_kind(mode)}, not a regular file", str(path))
        os.set_blocking(fd, True)  # no effect on regular files; restore the usual semantics
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_capped(f: BinaryIO, limit: int, path: str | Path, first: bytes = b"") -> bytes:
    """Read an open file to its end, refusing more than ``limit`` bytes (it may still grow);
    ``first``: what was read of it already (at most ``limit + 1`` bytes)."""
    data = first + f.read(limit + 1 - len(first))
    if len(data) > limit:
        raise FileTooLargeError(
            errno.EFBIG, f"larger than the {limit} bytes such a file may hold", str(path)
        )
    return data


def read_small(path: str | Path, limit: int, *, follow_symlinks: bool = False) -> bytes:
    """The whole content of a small regular file, at most ``limit`` bytes."""
    with open_regular(path, follow_symlinks=follow_symlinks) as f:
        return read_whole(f, limit, path)


def read_whole(f: BinaryIO, limit: int, path: str | Path) -> bytes:
    """The whole content of a file ``open_regular`` opened, at most ``limit`` bytes: refused
    before reading when its size is larger already."""
    size = os.fstat(f.fileno()).st_size
    if size > limit:
        raise FileTooLargeError(
            errno.EFBIG,
            f"{size} bytes, larger than the {limit} bytes such a file may hold",
            str(path),
        )
    # Sized by the file: a read of ``limit`` bytes allocates that much first, which costs more
    # than the read itself for the many small files of an image folder.
    data = f.read(size + 1)
    return data if len(data) <= size else read_capped(f, limit, path, data)  # it grew since


def read_json(path: str | Path, limit: int = JSON_LIMIT) -> Any:
    """``json.loads`` of a small regular file: ``OSError`` for a FIFO, a device, a link or an
    oversized file (see ``read_small``), ``ValueError`` for what is not JSON (nesting too deep
    for the parser included)."""
    data = read_small(path, limit)
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{path}: JSON nested too deeply") from None
