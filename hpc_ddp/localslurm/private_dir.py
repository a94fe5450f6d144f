"""The cluster dir belongs to the user who runs the daemons (root), and only to them.

The daemons run as root and read their config, their munge key and their state from this dir,
so whoever can write it (or rename it: write access to any dir above it) owns the cluster, and
through it root. Hence: every dir above it must be root's (or ours) and not writable by others,
unless sticky like /tmp, where others cannot rename what is not theirs; the dir itself is ours,
never a symlink, mode 0700. A dir that fails is refused, never repaired: someone else may
already have put files in it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from hpc_ddp.errors import ConfigError

MODE = 0o700
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


def _owner_ok(st: os.stat_result) -> bool:
    return st.st_uid in (0, os.geteuid())


def check_ancestors(root: Path) -> None:
    """Refuse a dir under a dir that another user could use to swap it out."""
    for parent in root.parents:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue  # created below by us, as root
        writable_by_others = st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX
        if not _owner_ok(st) or writable_by_others:
            raise ConfigError(
                f"the local cluster dir {root} is inside {parent} (owner uid {st.st_uid}, "
                f"mode {stat.filemode(st.st_mode)}), which another user can change: they could "
                "replace the cluster's config, and the daemons run it as root",
                hint="put the cluster dir under a dir only root can write, e.g. --dir "
                "/tmp/hpc-ddp-slurm or HPC_DDP_LOCAL_SLURM_DIR=/var/lib/hpc-ddp/slurm",
            )


def check(root: Path) -> None:
    """Refuse an existing ``root`` that is not ours alone (owner, symlink, group/other write)."""
    check_ancestors(root)
    try:
        st = os.lstat(root)
    except FileNotFoundError:
        return
    problem = ""
    if stat.S_ISLNK(st.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif not _owner_ok(st):
        problem = f"is owned by uid {st.st_uid}, not by root"
    elif st.st_mode & _OTHERS_WRITE:
        problem = f"is writable by group or others (mode {stat.filemode(st.st_mode)})"
    if problem:
        raise ConfigError(
            f"refusing the local cluster dir {root}: it {problem}; the cluster's daemons run "
            "as root and read their config and munge key from it",
            hint=f"remove it or pick another dir (--dir, HPC_DDP_LOCAL_SLURM_DIR); the local "
            f"cluster creates its dir itself, mode 0700 (`sudo rm -r {root}` if it is yours "
            "to delete)",
        )


def prepare(root: Path) -> None:
    """Check, then create ``root`` 0700 (or tighten an existing dir of ours to 0700)."""
    check(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, MODE)
    # Through a descriptor, so the dir checked is the dir tightened (no symlink swapped in).
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        check(root)
        if os.fstat(fd).st_ino != os.lstat(root).st_ino:
            raise ConfigError(f"the local cluster dir {root} changed while it was being set up")
        os.fchmod(fd, MODE)
    finally:
        os.close(fd)
