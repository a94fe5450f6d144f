"""Which entries of a local cluster's dir are the cluster's: the only ones start and stop remove.

A cluster names its files plainly (``jobs``, ``log``, ``state``, ``slurm.conf``...), and a dir a
user points ``--dir`` at may hold entries of the same names: a project root with its own
``jobs/``. So a name counts as the cluster's only in a dir that holds the cluster's marker,
written before anything else and removed after everything else. A dir without it is refused by
``start`` and left untouched by ``stop``.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from hpc_ddp.private_paths import create_file
from hpc_ddp.regular_file import open_regular

MARKER = ".hpc-ddp-local-cluster"
_MARKER_TEXT = "a local Slurm cluster of hpc-ddp (hpc_ddp/localslurm) lives in this dir\n"
# Everything a cluster writes in its dir besides the marker.
OWNED_NAMES = frozenset(
    {"state", "log", "run", "jobs", "spool", "dev", "slurm.conf", "daemons.conf", "gres.conf"}
    | {"munge.key", "cgroup.conf"}
)


def entries(root: Path) -> list[str]:
    """The names in ``root``, sorted; none where it does not exist."""
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


def holds_cluster(root: Path) -> bool:
    """Whether ``root`` holds the marker."""
    return _first_line(root / MARKER) == _MARKER_TEXT.rstrip("\n")


def foreign_entries(root: Path) -> list[str]:
    """The entries of ``root`` that are not the cluster's: all of them without the marker."""
    names = entries(root)
    if not holds_cluster(root):
        return names
    return [n for n in names if n not in OWNED_NAMES and n != MARKER]


def mark(root: Path) -> None:
    """Claim ``root`` (an empty dir the cluster just made private) before writing in it."""
    create_file(root / MARKER, _MARKER_TEXT.encode(), 0o644)


def remove_owned(root: Path) -> None:
    """Remove what the cluster wrote, the marker last, then ``root`` if that left it empty.
    Removes nothing from a dir that does not hold the cluster."""
    if not holds_cluster(root):
        return
    for name in OWNED_NAMES:
        path = root / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    (root / MARKER).unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # other files are still there: theirs, kept
        root.rmdir()


def _first_line(path: Path) -> str | None:
    """The first line of a regular file (never through a link, never blocking on a FIFO)."""
    try:
        with open_regular(path) as fh:
            return fh.read(4096).decode("utf-8", "replace").split("\n", 1)[0]
    except OSError:
        return None
