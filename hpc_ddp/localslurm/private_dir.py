"""The cluster dir belongs to the user who runs the daemons (root), and only to them.

The daemons run as root and read their config, their munge key and their state from this dir,
so whoever can write it (or rename it: write access to any dir above it) owns the cluster, and
through it root. The dir itself follows the toolkit's rule for private dirs
(hpc_ddp.private_paths: a real dir, ours, nobody else can write it; the cluster runs as root,
so "ours" is root's) and is kept at mode 0700. Beyond that rule, every dir above it must be
root's (or ours) and not writable by others, unless sticky like /tmp, where others cannot
rename what is not theirs. A dir that fails is refused, never repaired: someone else may
already have put files in it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from hpc_ddp.env_vars import LOCAL_SLURM_DIR_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.private_paths import SHARED_WRITE, private_dir_problem

MODE = 0o700


def check_ancestors(root: Path) -> None:
    """Refuse a dir under a dir that another user could use to swap it out."""
    for parent in root.parents:
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue  # created below by us, as root
        writable_by_others = st.st_mode & SHARED_WRITE and not st.st_mode & stat.S_ISVTX
        if st.st_uid not in (0, os.geteuid()) or writable_by_others:
            raise ConfigError(
                f"the local cluster dir {root} is inside {parent} (owner uid {st.st_uid}, "
                f"mode {stat.filemode(st.st_mode)}), which another user can change: they could "
                "replace the cluster's config, and the daemons run it as root",
                hint="put the cluster dir under a dir only root can write, e.g. --dir "
                f"/tmp/hpc-ddp-slurm or {LOCAL_SLURM_DIR_VAR}=/var/lib/hpc-ddp/slurm",
            )


def check(root: Path) -> None:
    """Refuse an existing ``root`` that is not a private dir of ours, or sits where another
    user could swap it out."""
    check_ancestors(root)
    try:
        problem = private_dir_problem(root)
    except FileNotFoundError:
        return
    if problem:
        raise ConfigError(
            f"refusing the local cluster dir {root}: it is {problem}; the cluster's daemons run "
            "as root and read their config and munge key from it",
            hint=f"remove it or pick another dir (--dir, {LOCAL_SLURM_DIR_VAR}); the local "
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
