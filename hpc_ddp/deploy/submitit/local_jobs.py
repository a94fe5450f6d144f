"""A submitit LocalExecutor job seen from another process: alive or not, and how to stop it.

A local job's id is the pid of submitit's controller, which starts one task process per rank
(each running ``ProgramTask``, whose child is the program: the trainer or a script). Another
process has no Popen for it, so this module reads /proc. Stopping with a checkpoint sends SIGINT
to the tasks, not the controller: the controller answers SIGINT by killing its tasks a second
later, too soon for a checkpoint, while a task answers it by sending its program SIGTERM (on
which the trainer checkpoints and exits) and waiting for it (``ProgramTask._end_child``).

A pid alone proves nothing: any process may hold it (one of another user's, or a new one after
the job ended and the pid was reused). So submission records each local job it starts
(``remember_local_jobs``): the controller's pid, its start time, the boot and the job's folder,
in a file of the toolkit's private state dir. ``stop_local`` signals a controller, and the
processes it started, only when that record matches the live process (``proven_controller``).
Torch-free.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from hpc_ddp import regular_file
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.polling import poll_until
from hpc_ddp.private_paths import ensure_private_dir, lasting_state_base, replace_file

# Under the lasting state dir: a local job may outlive the login session that submitted it.
RECORDS_DIR = "local-jobs"
# A record's name: the controller's pid and its start time (clock ticks after boot).
_RECORD = re.compile(r"([0-9]{1,10})-([0-9]{1,20})\.json", re.ASCII)
_RECORD_LIMIT = 1 << 16
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


class _Stat(NamedTuple):
    state: str  # R, S, Z...
    ppid: int
    start: int  # clock ticks after boot: with the pid, names one process of this boot


def _stat(pid: int) -> _Stat | None:
    """State letter, parent pid and start time of ``pid``, None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return _Stat(fields[0], int(fields[1]), int(fields[19]))


def controller_alive(job_id: str) -> bool:
    """Whether the controller of local job ``job_id`` still runs (and is submitit's)."""
    stat = _stat(int(job_id))
    if stat is None or stat.state in ("Z", "X"):
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
        if stat is not None and stat.ppid == pid and stat.state not in ("Z", "X"):
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


def local_records() -> Path:
    """The private dir of the records of local jobs (created, or checked: HpcDdpError if
    another user could change it). Submission asks for it first, so that a dir it refuses stops
    the submission before a job runs unrecorded."""
    return ensure_private_dir(ensure_private_dir(lasting_state_base()) / RECORDS_DIR)


def _boot_id() -> str:
    return regular_file.read_small(_BOOT_ID, 64).decode().strip()


def remember_local_jobs(jobs: Iterable[Any], folder: Path) -> None:
    """Record the controller of each local job just submitted (submitit's ``LocalJob``s, whose
    id is the controller's pid), with the job's ``folder``: the proof ``stop_local`` asks for.
    Records of controllers that have ended are removed (they are this module's own files)."""
    records = local_records()
    for entry in records.iterdir():
        if (named := _RECORD.fullmatch(entry.name)) is not None:
            stat = _stat(int(named.group(1)))
            if stat is None or stat.start != int(named.group(2)):
                entry.unlink(missing_ok=True)
    boot, where = _boot_id(), str(Path(folder).resolve())
    for job in jobs:
        pid = int(job.job_id)
        if (stat := _stat(pid)) is None:
            continue  # already ended: there is nothing to stop
        record = {"pid": pid, "start": stat.start, "boot": boot, "folder": where}
        replace_file(records / f"{pid}-{stat.start}.json", json.dumps(record).encode(), 0o600)


def proven_controller(job_id: str, folder: Path) -> int:
    """The pid of local job ``job_id``'s controller, once this toolkit's record of starting it
    (``remember_local_jobs``) matches the live process: same pid, start time, boot and folder.
    HpcDdpError otherwise: a process the toolkit did not start is never signalled."""
    pid = int(job_id)
    start = stat.start if (stat := _stat(pid)) is not None else -1
    record_path = local_records() / f"{pid}-{start}.json"
    try:
        record = regular_file.read_json(record_path, _RECORD_LIMIT)
    except (OSError, ValueError):
        record = None
    this = {"pid": pid, "start": start, "boot": _boot_id()}
    where = str(Path(folder).resolve())
    if not isinstance(record, dict) or any(record.get(k) != v for k, v in this.items()):
        why = f"hpc-ddp has no record of starting process {pid} (in {record_path.parent})"
    elif record.get("folder") != where:
        why = f"hpc-ddp started job {pid} with the folder {record.get('folder')}, not {where}"
    else:
        return pid
    raise HpcDdpError(
        f"not stopping local job {job_id}: {why}; only a process that hpc-ddp started itself, "
        "and is still the same process, is signalled",
        hint="give the id and --folder that `hpc-ddp submit --executor local` printed; a "
        "process started otherwise is yours to stop with kill",
    )


def stop_local(job: Any, *, now: bool, timeout_s: float, on_event: Callable[[str], None]) -> str:
    """Stop a local submitit job (see the module's docstring); returns its final state.
    HpcDdpError, nothing signalled, unless the toolkit can prove it started the job."""
    if not controller_alive(job.job_id):
        return str(job.status())  # it ended meanwhile: nothing to stop
    pid = proven_controller(job.job_id, job.folder)
    if now:
        on_event(f"job {job.job_id}: SIGKILL to the controller and every task")
        _signal([pid, *_descendants(pid)], signal.SIGKILL)
    else:
        on_event(f"job {job.job_id}: SIGINT to its tasks, waiting for the checkpoint")
        _signal(children(pid), signal.SIGINT)
    if not _gone(job.job_id, timeout_s):
        on_event(f"job {job.job_id}: no end after {timeout_s:.0f} s; SIGKILL")
        _signal([pid, *_descendants(pid)], signal.SIGKILL)
        if not _gone(job.job_id, 30):
            raise HpcDdpError(f"local submitit job {job.job_id} survived SIGKILL")
    job.mark_cancelled()
    return str(job.status())


def _gone(job_id: str, timeout_s: float) -> bool:
    return bool(poll_until(lambda: not controller_alive(job_id), timeout_s))
