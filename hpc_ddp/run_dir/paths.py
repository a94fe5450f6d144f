"""``RunPaths``: every name in a run directory, and the path of each (nothing is read or
created here). Pure Python and torch-free: the deploy layer (which reports a job's result) and
the monitors use it as well as the trainer and the checkpoints."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.slurm_client import MAX_RESTARTS, is_job_id, slurm_job_to_requeue

MARKER = ".hpc-ddp-run"
LOCK = ".run.lock"
LOCK_OWNER = ".run.lock.owner"
CONFIG = "config.json"
PROGRESS = "progress.json"
# progress.json's record of the Slurm job writing it: {"id": "12", "restarts": 1}. It outlives
# the lock's owner file, so that a run dir still names its job (and requeues) once it ended.
PROGRESS_SLURM_JOB = "slurm_job"
NCCL_TRACE = "nccl_trace"
# torch's variable naming the prefix of flight recorder dump files (<prefix><rank>). torch opens
# the file without creating its directory, so the trainer makes nccl_trace/ when this points
# into it (RunPaths.wants_nccl_trace).
FR_DUMP_FILE_VAR = "TORCH_FR_DUMP_TEMP_FILE"
METRICS = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
TENSORBOARD = "tensorboard"
RESULT = "result.json"
PLOT = "plot.png"
CHECKPOINTS = "checkpoints"
LATEST = "latest"  # inside checkpoints/
MANIFEST = "manifest.json"  # inside each checkpoint directory
STEP_PREFIX = "step-"  # a committed checkpoint directory: step-NNNNNNNN
REQUEUE_MARKER_PREFIX = ".requeue-job-"


def requeue_marker_name(job: str, restart: str) -> str:
    """``.requeue-job-J-restart-R``: the marker of Slurm job ``J``'s run number ``R``
    (SLURM_RESTART_COUNT). Keyed to both, so a marker an earlier run left is never this run's.
    The sbatch template spells it with shell variables for ``job`` and ``restart``."""
    return f"{REQUEUE_MARKER_PREFIX}{job}-restart-{restart}"


def requeue_marker_line(job: str, restart: str) -> str:
    """The one line a requeue marker holds: the batch shell compares it whole, so a file that
    the toolkit did not write is neither taken for a marker nor removed. No quote, ``$``,
    backtick or backslash of its own: the template puts it in double quotes."""
    return f"hpc-ddp checkpointed for requeue: job {job} restart {restart}"


def step_dir_name(step: int) -> str:
    """``step-00000040``: the name of the committed checkpoint of optimizer step ``step``."""
    return f"{STEP_PREFIX}{step:08d}"


@dataclass(frozen=True, init=False)
class RunPaths:
    """Every path of one run directory. Only computes paths: nothing is read or created."""

    root: Path

    def __init__(self, root: str | os.PathLike[str]) -> None:
        object.__setattr__(self, "root", Path(root))

    @property
    def marker(self) -> Path:
        """``.hpc-ddp-run``: present in every directory the trainer made."""
        return self.root / MARKER

    @property
    def lock(self) -> Path:
        """``.run.lock``: the OS lock rank 0 holds while the run lives."""
        return self.root / LOCK

    @property
    def lock_owner(self) -> Path:
        """``.run.lock.owner``: pid, host and Slurm job of the lock's holder (informational)."""
        return self.root / LOCK_OWNER

    @property
    def config(self) -> Path:
        """``config.json``: the run's resolved settings (a resume must match them)."""
        return self.root / CONFIG

    @property
    def progress(self) -> Path:
        """``progress.json``: where training stands, rewritten while it runs."""
        return self.root / PROGRESS

    @property
    def metrics(self) -> Path:
        """``metrics.jsonl``: one JSON line per finished epoch."""
        return self.root / METRICS

    @property
    def metrics_csv(self) -> Path:
        """``metrics.csv``: a row per progress line and per epoch (``--metrics csv``)."""
        return self.root / METRICS_CSV

    @property
    def tensorboard(self) -> Path:
        """``tensorboard/``: TensorBoard's event files (``--metrics tensorboard``)."""
        return self.root / TENSORBOARD

    @property
    def result(self) -> Path:
        """``result.json``: the outcome; its presence means the run has finished."""
        return self.root / RESULT

    @property
    def plot(self) -> Path:
        """``plot.png``: loss and accuracy per epoch."""
        return self.root / PLOT

    @property
    def nccl_trace(self) -> Path:
        """``nccl_trace/``: NCCL flight recorder dumps (``rank_N``), written on a timeout."""
        return self.root / NCCL_TRACE

    def wants_nccl_trace(self, environ: Mapping[str, str]) -> bool:
        """Whether the flight recorder's dump prefix in ``environ`` names files in
        ``nccl_trace/`` (as rendered GPU jobs set it): then that directory must exist."""
        prefix = environ.get(FR_DUMP_FILE_VAR, "")
        return bool(prefix) and Path(prefix).absolute().parent == self.nccl_trace.absolute()

    @property
    def checkpoints(self) -> Path:
        """``checkpoints/``: the committed checkpoints and the ``latest`` pointer."""
        return self.root / CHECKPOINTS

    @property
    def latest(self) -> Path:
        """``checkpoints/latest``: names the newest committed checkpoint directory."""
        return self.checkpoints / LATEST

    def step_dir(self, step: int) -> Path:
        """``checkpoints/step-NNNNNNNN``: the checkpoint of optimizer step ``step``."""
        return self.checkpoints / step_dir_name(step)

    def manifest(self, step: int) -> Path:
        """The manifest that makes the checkpoint of ``step`` self-verifying."""
        return self.step_dir(step) / MANIFEST

    def requeue_marker(self, job: str, restart: str) -> Path:
        """``.requeue-job-J-restart-R``: rank 0 checkpointed after a preemption signal and left
        the requeue to the batch shell of job ``J``, run ``R`` (see :func:`requeue_marker_name`)."""
        return self.root / requeue_marker_name(job, restart)

    def __fspath__(self) -> str:
        return os.fspath(self.root)


def slurm_attempt(environ: Mapping[str, str]) -> dict[str, Any] | None:
    """The Slurm job this process runs in and how often Slurm has requeued it (the id an array
    task is known by, and SLURM_RESTART_COUNT), or None outside Slurm."""
    job = slurm_job_to_requeue(environ)
    restart = environ.get("SLURM_RESTART_COUNT") or "0"
    counted = restart.isascii() and restart.isdigit() and int(restart) <= MAX_RESTARTS
    if job is None or not is_job_id(job) or not counted:
        return None
    return {"id": job, "restarts": int(restart)}
