"""Preemption: a signal sets a flag; ranks agree at step boundaries; checkpoint; requeue; exit 75.

The handler does nothing but set a flag: checkpointing inside a signal handler could interrupt a
collective half-way and deadlock the job. Slurm sends SIGTERM at preemption and at the end of the
time limit (after ``--signal=USR1@N`` if asked), so both are handled by default.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType

from hpc_ddp.env_vars import REQUEUE_BY_BATCH, REQUEUE_BY_BATCH_MARKER, REQUEUE_BY_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.exit_codes import EXIT_REQUEUE as EXIT_REQUEUE  # re-exported for callers
from hpc_ddp.private_paths import create_file
from hpc_ddp.run_dir.paths import RunPaths, requeue_marker_line
from hpc_ddp.slurm_client import slurm_job_to_requeue

_COUNT = re.compile(r"[0-9]{1,20}", re.ASCII)  # a Slurm job id or restart count


def parse_signal(name: str | int) -> signal.Signals:
    """'USR1', 'SIGUSR1', 'usr1' or 10 -> signal.SIGUSR1."""
    try:
        if isinstance(name, int) or str(name).isdigit():
            return signal.Signals(int(name))
        text = str(name).strip().upper()
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(
            f"unknown signal {name!r}", hint="use a name such as USR1, USR2 or TERM"
        ) from None


@dataclass
class PreemptionFlag:
    """Installs handlers for ``signals``; ``requested`` turns true when one arrives."""

    signals: tuple[signal.Signals, ...]
    received: list[str] = field(default_factory=list)
    _previous: dict[signal.Signals, object] = field(default_factory=dict)

    @classmethod
    def install(cls, names: Iterable[str | int]) -> PreemptionFlag:
        flag = cls(tuple(parse_signal(n) for n in names))
        for sig in flag.signals:
            flag._previous[sig] = signal.signal(sig, flag._handle)
        return flag

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received.append(signal.Signals(signum).name)

    @property
    def requested(self) -> bool:
        return bool(self.received)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]
        self._previous.clear()


def under_submitit(environ: Mapping[str, str]) -> bool:
    return any(k.startswith("SUBMITIT_") for k in environ)


def requeue(
    mode: str, environ: Mapping[str, str] | None = None, *, run_paths: RunPaths | None = None
) -> str:
    """Ask the scheduler to run this job again; returns a sentence saying what happened.

    auto: ``scontrol requeue`` inside a Slurm job unless submitit or the batch script (which says
    so in REQUEUE_BY_VAR) requeues; elsewhere nothing. scontrol: always try. none: never (the
    caller's launcher decides, e.g. submitit). Call it after the checkpoint has committed: under
    ``batch-marker`` it leaves the marker in ``run_paths`` that tells the batch script so.
    """
    environ = os.environ if environ is None else environ
    if mode == "none":
        return "requeue=none: not requeueing; exit 75 tells the launcher to restart the job"
    job = slurm_job_to_requeue(environ)
    if mode == "auto":
        if environ.get(REQUEUE_BY_VAR) == REQUEUE_BY_BATCH:
            return "exit 75 asks the batch script, which requeues the job from the host shell"
        if environ.get(REQUEUE_BY_VAR) == REQUEUE_BY_BATCH_MARKER:
            return leave_requeue_marker(run_paths, environ)
        if under_submitit(environ):
            return "running under submitit, which requeues through its own checkpoint path"
        if job is None:
            return "not inside a Slurm job: nothing to requeue; exit 75 means 'run me again'"
    if job is None:
        return "requeue=scontrol but SLURM_JOB_ID is not set: cannot requeue; exiting 75"
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"scontrol not found on PATH: cannot requeue job {job}; exiting 75"
    try:
        with _children_keep_sigterm_blocked():
            done = subprocess.run(
                [scontrol, "requeue", job], capture_output=True, text=True, timeout=60, check=False
            )
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"scontrol requeue {job} failed ({err}); exiting 75"
    if done.returncode != 0:
        return f"scontrol requeue {job} failed (rc {done.returncode}): {done.stderr.strip()}"
    return f"requeued Slurm job {job} (scontrol requeue)"


@contextmanager
def _children_keep_sigterm_blocked() -> Iterator[None]:
    """Processes started inside inherit SIGTERM blocked (a thread's signal mask survives fork and
    exec). slurmctld answers ``scontrol requeue`` while it has every process of the job
    SIGTERMed, scontrol included: blocked, that signal cannot end scontrol before its reply, so
    a requeue that succeeded is not reported as failed (rc -15). A SIGTERM meant for this
    process is not lost: another thread takes it, or this one when the block ends. (Under
    submitit, which runs its own scontrol: deploy/submitit/requeue.py.)"""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def leave_requeue_marker(run_paths: RunPaths | None, environ: Mapping[str, str]) -> str:
    """Tell the batch script that the run checkpointed and wants a requeue, through a file.

    torchrun reports its workers' exit 75 as 1, so the batch shell of the torchrun layout cannot
    tell a preemption from a crash by the step's exit code (and torchrun's error files record
    uncaught exceptions, not exit codes). The run dir is the one place that
    both this process and that shell see (in a container too: the host reads result.json there),
    so rank 0 leaves :meth:`RunPaths.requeue_marker` there, named for this job and restart,
    and the shell requeues only when it finds it. Never replaces a file already there.
    """
    job, restart = environ.get("SLURM_JOB_ID", ""), environ.get("SLURM_RESTART_COUNT") or "0"
    if run_paths is None:
        return "no run dir to leave the batch script's requeue marker in: exiting 75, not requeued"
    if not (_COUNT.fullmatch(job) and _COUNT.fullmatch(restart)):
        return (
            f"SLURM_JOB_ID {job!r} or SLURM_RESTART_COUNT {restart!r} is not a number: "
            "no requeue marker for the batch script; exiting 75, not requeued"
        )
    marker = run_paths.requeue_marker(job, restart)
    try:
        create_file(marker, (requeue_marker_line(job, restart) + "\n").encode())
    except FileExistsError:
        return f"{marker} is already there and not this run's: left alone; not requeued"
    except OSError as err:
        return f"cannot write the requeue marker {marker} ({err.strerror}): not requeued"
    return f"left {marker} for the batch script, which requeues the job from the host shell"


def default_signals(environ: Mapping[str, str]) -> tuple[str, ...]:
    """USR1 and TERM; under submitit also the signal it sends before preemption and the time
    limit: ``SUBMITIT_PREEMPT_SIGNAL``, USR2 unless that is set."""
    if not under_submitit(environ):
        return ("USR1", "TERM")
    submitit = environ.get("SUBMITIT_PREEMPT_SIGNAL") or "USR2"
    return tuple(dict.fromkeys(("USR1", submitit, "TERM")))


class Preemption:
    """Preemption for a training loop of your own: the pieces the trainer uses, in one object.

    ``Preemption()`` installs handlers for ``signals``: by default USR1 and TERM (Slurm sends
    SIGTERM at preemption and at the time limit, after ``--signal=USR1@N`` if the job asks), plus
    submitit's warning signal (USR2) under submitit. In the loop, call
    :meth:`agreed` at step boundaries: it is True on every rank once any rank got a signal (one
    all-reduce, so call it on all ranks at the same steps). Then save a checkpoint on all ranks,
    call :meth:`requeue` on rank 0 and leave with ``shutdown(Preemption.EXIT_CODE)`` (75).
    """

    EXIT_CODE = EXIT_REQUEUE

    def __init__(self, signals: Iterable[str | int] | None = None) -> None:
        if signals is None:
            signals = default_signals(os.environ)
        self.flag = PreemptionFlag.install(signals)

    @property
    def requested(self) -> bool:
        """A signal reached this process (other ranks may not know yet)."""
        return self.flag.requested

    @property
    def received(self) -> list[str]:
        """The names of the signals that reached this process, in order (``SIGUSR1``...)."""
        return self.flag.received

    @property
    def signals(self) -> tuple[signal.Signals, ...]:
        """The signals it handles."""
        return self.flag.signals

    def agreed(self) -> bool:
        """Whether any rank got a signal: the same answer on every rank (a collective)."""
        import torch
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return self.requested
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        vote = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(vote, op=dist.ReduceOp.MAX)
        return bool(vote.item())

    def requeue(self, mode: str = "auto") -> str:
        """Ask the scheduler to run the job again (see :func:`requeue`); returns what happened."""
        return requeue(mode)

    def close(self) -> None:
        """Restore the signal handlers that were there before."""
        self.flag.uninstall()
