"""Whose directory is this? The trainer writes only into a run dir that it made.

``--run-dir`` pointed at a directory of other files must not become a run dir: the trainer
replaces config.json, progress.json, metrics.jsonl, metrics.csv, result.json and plot.png there,
writes into tensorboard/ and cleans up inside checkpoints/. So rank 0, before it writes anything
there (the lock included):

- a missing or empty directory becomes a run dir: ``.hpc-ddp-run`` is created in it;
- a directory holding ``.hpc-ddp-run`` (a regular file in this format) is a run dir;
- anything else is refused, naming what the directory holds.

Not counted as content: the lock files of a run that died before writing the marker, and under
Slurm the job's own log if its name carries the job id (``%j``/``%A``): job specs put
``--output`` into the run dir, and Slurm creates that file before the trainer starts.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hpc_ddp
from hpc_ddp.errors import ConfigError, first_few
from hpc_ddp.private_paths import create_file
from hpc_ddp.regular_file import read_small

from .lock import is_lock_leftover, unwritable
from .paths import MARKER

FORMAT = "hpc-ddp-run/1"
_FORMAT_PREFIX = "hpc-ddp-run/"
_MAX_MARKER_BYTES = 4096
_JOB_ID = re.compile(r"[0-9]+")
_JOB_ID_VARS = ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID")
_HINT = "choose an empty or new --run-dir (the trainer creates it)"


def claim_run_dir(run_dir: Path, environ: Mapping[str, str] | None = None) -> None:
    """Make ``run_dir`` a run dir of ours, or raise ConfigError if it is someone else's."""
    run_dir = Path(run_dir)
    try:
        entries = os.listdir(run_dir)
    except FileNotFoundError:
        entries = []
    except OSError as err:
        raise ConfigError(
            f"cannot use {run_dir} as the run dir: {err.strerror}", hint=_HINT
        ) from None
    if MARKER in entries:
        _check_marker(run_dir / MARKER)
        return
    env = os.environ if environ is None else environ
    others = sorted(
        e for e in entries if not is_lock_leftover(run_dir / e) and not _job_log(run_dir, e, env)
    )
    if others:
        raise ConfigError(
            f"run dir {run_dir} is not empty and is not an hpc-ddp run dir (it has no {MARKER}): "
            f"it holds {first_few(others, 5)}",
            hint=f"{_HINT}; the trainer never writes into a directory of other files",
        )
    marker = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "hpc_ddp": hpc_ddp.__version__}  # fmt: skip
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        create_file(run_dir / MARKER, (json.dumps(marker) + "\n").encode())
    except FileExistsError:
        _check_marker(run_dir / MARKER)  # a second start raced this one; the lock decides next
    except OSError as err:
        if run_dir.is_dir():  # it exists but cannot hold our files: the lock's own error says so
            raise unwritable(run_dir, run_dir / MARKER, err) from None
        raise ConfigError(
            f"cannot create the run dir {run_dir}: {err.strerror}", hint=_HINT
        ) from None


def _check_marker(path: Path) -> None:
    try:
        marker: Any = json.loads(read_small(path, _MAX_MARKER_BYTES))  # never through a link
    except (OSError, ValueError):
        marker = None
    if not isinstance(marker, dict) or not str(marker.get("format", "")).startswith(_FORMAT_PREFIX):
        raise ConfigError(
            f"{path} is not a run dir marker written by hpc-ddp (a link, not a file, or not "
            f"of the format {FORMAT})",
            hint=f"{_HINT}; the trainer writes only into run dirs it made",
        )


def _job_log(run_dir: Path, name: str, env: Mapping[str, str]) -> bool:
    """Is ``name`` a regular file named with this Slurm job's id (its own ``--output``)?"""
    ids = [env[v] for v in _JOB_ID_VARS if _JOB_ID.fullmatch(env.get(v, ""))]
    if not any(re.search(rf"(?<![0-9]){job_id}(?![0-9])", name) for job_id in ids):
        return False
    try:
        return stat.S_ISREG(os.lstat(run_dir / name).st_mode)
    except OSError:
        return False
