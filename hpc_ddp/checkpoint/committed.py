"""Which checkpoints are committed: the ``latest`` pointer (moving it is the commit), the
directories an interrupted save leaves, and pruning to ``keep``. The names are the run dir's
(``hpc_ddp.run_dir.paths``)."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from hpc_ddp.regular_file import read_small
from hpc_ddp.run_dir.paths import LATEST, STEP_PREFIX

from .fsutil import fsync_dir, remove_tree, write_bytes_durably
from .manifest import TMP_PREFIX, TRASH_PREFIX, parse_step, step_dirs

Log = Callable[[str], None]
LATEST_MAX_BYTES = 4096  # it holds one directory name

# Exactly the names saves give their directories: tmp_dir_name(step) while writing, and
# "<TRASH_PREFIX><step dir>-<pid>" for one being replaced or pruned. Anything else that merely
# starts with ".tmp-" is not ours to delete.
_LEFTOVER = re.compile(
    rf"{re.escape(TMP_PREFIX + STEP_PREFIX)}[0-9]{{8,}}"
    rf"|{re.escape(TRASH_PREFIX + STEP_PREFIX)}[0-9]{{8,}}-[0-9]+"
)


def read_latest(root: Path) -> tuple[str | None, str | None]:
    """(directory name, problem). Both None: there is no pointer at all."""
    try:
        # A plain file by design (write_latest): a symlink, FIFO or device there was planted.
        raw = read_small(root / LATEST, LATEST_MAX_BYTES)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"cannot read {root / LATEST}: {exc.strerror}"
    try:
        name = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        return None, f"{root / LATEST} is not text ({len(raw)} bytes)"
    if parse_step(name) is None:
        return None, f"{root / LATEST} holds {name[:40]!r}, not a step-NNNNNNNN name"
    return name, None


def write_latest(root: Path, name: str) -> None:
    # A plain file replaced atomically rather than a symlink: it survives copies (rsync -L,
    # object stores, Windows shares), and a torn write is impossible with os.replace.
    write_bytes_durably(root / LATEST, f"{name}\n".encode())


def is_leftover(entry: os.DirEntry[str]) -> bool:
    """A directory (not a link) named as a save names its temporary or trash directories, owned
    by this user: what a crashed save of ours leaves, never someone else's file."""
    if not _LEFTOVER.fullmatch(entry.name):
        return False
    st = entry.stat(follow_symlinks=False)
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def clean_leftovers(root: Path, log: Log, *, keep: str | None = None) -> None:
    """Remove temporary and trash directories left by saves that crashed (rank 0 only)."""
    for entry in os.scandir(root):
        if entry.name != keep and is_leftover(entry):
            log(f"checkpoint: removing {entry.name}, left by an interrupted save")
            remove_tree(Path(entry.path), log)


def prune(root: Path, committed_step: int, keep: int, log: Log) -> None:
    """Keep the ``keep`` newest checkpoints up to the committed one; drop the rest.

    Directories newer than the committed step come from a timeline this run abandoned (a save
    that died between its rename and the pointer move, or a manual roll-back of ``latest``):
    they are removed too, or they would shadow the run's real history forever.
    """
    kept = 0
    for step, path in step_dirs(root):
        if step > committed_step:
            log(f"checkpoint: removing {path.name}: newer than the committed step {committed_step}")
        elif kept < keep:
            kept += 1
            continue
        else:
            log(f"checkpoint: pruning {path.name} (keep={keep})")
        trash = root / f"{TRASH_PREFIX}{path.name}-{os.getpid()}"
        # Rename first so a crash mid-delete leaves a trash dir, never a half-deleted step dir.
        os.rename(path, trash)
        remove_tree(trash, log)
    fsync_dir(root)
