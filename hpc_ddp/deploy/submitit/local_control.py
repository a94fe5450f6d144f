"""A submitit LocalExecutor job seen from another process: alive or not, and how to stop it.

A local job's id is the pid of submitit's controller, which starts one task process per rank
(each running ``ProgramTask``, whose child is the program: the trainer or a script). Another
process has no Popen for it, so this module reads /proc. Stopping with a checkpoint sends SIGINT
to the tasks, not the controller: the controller answers SIGINT by killing its tasks a second
later, too soon for a checkpoint, while a task answers it by sending its program SIGTERM (on
which the trainer checkpoints and exits) and waiting for it (``ProgramTask._end_child``).
Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpc_ddp.errors import HpcDdpError


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of ``pid``, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[0], int(fields[1])


def controller_alive(job_id: str) -> bool:
    """Whether the controller of local job ``job_id`` still runs (and is submitit's)."""
    stat = _stat(int(job_id))
    if stat is None or stat[0] in ("Z", "X"):
        return False
    try:
        cmdline = Path(f"/proc/{job_id}/cmdline").read_bytes()
    except OSError:
        return False
    return b"submitit" in cmdline


def controller_cwd(job_id: str) -> Path:
    """Where the job runs (its submitter's directory), while it runs; else this directory."""
    if controller_alive(job_id):
        try:
            return Path(os.readlink(f"/proc/{job_id}/cwd"))
        except OSError:
            pass
    return Path.cwd()


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        stat = _stat(int(entry.name)) if entry.name.isdigit() else None
        if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def cancellable_by_sigint() -> Iterator[None]:
    """Submit inside this: the local job's controller and tasks then answer SIGINT, the signal
    every local cancel sends (submitit's ``Job.cancel`` to the controller, ``stop_local`` to the
    tasks), even when this process ignores it (a script's ``cmd &`` starts it so). An ignored
    signal stays ignored across exec, and such a job could only be killed without a checkpoint
    once the cancel timed out; a handler is reset to the default in an exec'd child. The handler
    does nothing, so this process goes on ignoring SIGINT meanwhile."""
    main = threading.current_thread() is threading.main_thread()
    if not main or signal.getsignal(signal.SIGINT) != signal.SIG_IGN:
        yield
        return
    signal.signal(signal.SIGINT, lambda _signum, _frame: None)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def stop_local(job: Any, *, now: bool, timeout_s: float, on_event: Callable[[str], None]) -> str:
    """Stop a local submitit job (see the module's docstring); returns its final state."""
    pid = int(job.job_id)
    if now:
        on_event(f"job {job.job_id}: SIGKILL to the controller and every task")
        _signal([pid, *_descendants(pid)], signal.SIGKILL)
    else:
        on_event(f"job {job.job_id}: SIGINT to its tasks, waiting for the checkpoint")
        _signal(children(pid), signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    while controller_alive(job.job_id):
        if time.monotonic() > deadline:
            on_event(f"job {job.job_id}: no end after {timeout_s:.0f} s; SIGKILL")
            _signal([pid, *_descendants(pid)], signal.SIGKILL)
            deadline = time.monotonic() + 30
            if not _gone(job.job_id, 30):
                raise HpcDdpError(f"local submitit job {job.job_id} survived SIGKILL")
        time.sleep(0.1)
    job.mark_cancelled()
    return str(job.status())


def _gone(job_id: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not controller_alive(job_id):
            return True
        time.sleep(0.1)
    return False
