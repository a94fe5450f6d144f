"""The one interface every backend implements, and what its members return.

A ``Backend`` turns a spec into a ``DryRun`` (``describe``: the script, nothing runs) and runs
exactly that (``submit``), which gives a ``Job`` to ask (``status``), wait for (``wait``) and
stop (``cancel``). Rendering a job and a dry run of its submission are therefore one operation.

=========  ====================================  ==================================
executor   backend                               describe() text
=========  ====================================  ==================================
sbatch     sbatch/backend.py   SbatchBackend     the batch script (``hpc-ddp render``)
submitit   submitit/backend.py SubmititBackend   the task every process runs
local      (submitit's LocalExecutor)            the same, on this machine
pdsh       shell/backend.py    ShellBackend      the launch script (``--render-script``)
clush      (the same, with clush)                the same
=========  ====================================  ==================================

Which backend an executor has, and what else the code around it asks of one, is its entry in
``hpc_ddp.deploy.executors.EXECUTORS``.

Job states use Slurm's names for every backend (PENDING, RUNNING, COMPLETED, FAILED,
CANCELLED, TIMEOUT...). Never imports torch, Slurm or submitit itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from hpc_ddp import regular_file
from hpc_ddp.run_dir.paths import RunPaths


@dataclass(frozen=True)
class DryRun:
    """What a backend would run, as text; ``Backend.submit`` runs exactly this."""

    executor: str
    text: str  # the script itself (str(dry_run) is the same text)
    command: str  # the one command line that would start it
    request: Any = field(repr=False)  # what the backend's submit needs (its own business)
    run_paths: RunPaths | None = None  # the run dir whose result.json the job reports
    program: str | None = None  # the module it runs (python -m), whose hook shows the result

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Finished:
    """How a job ended."""

    job_id: str
    state: str  # COMPLETED, FAILED, CANCELLED, TIMEOUT, ... (Slurm's names)
    exit_code: int  # the job's code, as a shell reports it (128 + N for signal N)
    restarts: int = 0  # how often it was requeued
    output: Path | None = None  # its log, if it has one file
    result: Mapping[str, Any] | None = None  # the program's result.json, if it wrote one
    error: str = ""  # what failed, when the backend knows more than the exit code


class Job(ABC):
    """A submitted job, whichever backend started it."""

    executor: str  # which backend started it
    job_id: str  # Slurm's job id, or the launch id of a pdsh/clush launch
    output: Path | None = None  # the log a person would read, if there is one file
    run_paths: RunPaths | None = None  # the run dir whose result.json the job reports
    program: str | None = None  # the module it runs (python -m), whose hook shows the result

    @abstractmethod
    def status(self) -> str:
        """The state now: PENDING, RUNNING, or how it ended (COMPLETED, FAILED...)."""

    @abstractmethod
    def wait(self, timeout_s: float | None = None) -> Finished:
        """Block until the job has ended (following requeues); at the deadline cancel it and
        raise HpcDdpError. Waiting again returns the same answer."""

    @abstractmethod
    def cancel(self) -> None:
        """End the job now, every process of it; a job that has ended already is left alone."""

    def read_result(self) -> dict[str, Any] | None:
        """The trainer's result.json, once it exists (None before, or without a trainer)."""
        return read_result(self.run_paths)


class Backend(ABC):
    """One way to run a job: sbatch, submitit, or a scheduler-less pdsh/clush launch."""

    executor: ClassVar[str]

    @abstractmethod
    def describe(self, spec: Any) -> DryRun:
        """What ``submit`` would run, as the script's text; runs and writes nothing."""

    @abstractmethod
    def submit(self, plan: DryRun) -> Job:
        """Start what ``describe`` returned; returns once the job is queued or started."""


def read_result(run_paths: RunPaths | None) -> dict[str, Any] | None:
    """result.json of a run dir, None while it is absent (or unreadable: not the trainer's, which
    writes it whole through a rename)."""
    if run_paths is None:
        return None
    try:
        data = regular_file.read_json(run_paths.result)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
