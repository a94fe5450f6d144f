"""Writing a rendered script: whole or not at all, and never over a file without --force."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from hpc_ddp.errors import ConfigError


def write_atomic(path: Path, text: str, *, force: bool = False, mode: int = 0o644) -> None:
    """Write via a temporary file in the same directory and rename: never a half-written job."""
    if os.path.lexists(path) and not force:  # a dangling link too: someone's, pointing ahead
        what = "is a symbolic link" if path.is_symlink() else "exists"
        raise ConfigError(f"{path} {what}", hint="pass --force to overwrite it")
    if not path.parent.is_dir():
        raise ConfigError(
            f"directory {path.parent} does not exist", hint="create it or choose another -o path"
        )
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
