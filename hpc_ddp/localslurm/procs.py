"""Processes by pid, read from /proc: liveness, descendants, and who belongs to a cluster.

Never by name: several clusters (other test sessions, the demo) run on one machine at once, and
`pkill slurmd` would take theirs down too.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable
from pathlib import Path

from hpc_ddp.polling import poll_until

PROC = Path("/proc")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and ")", so split after the last ")".
    return text[text.rfind(")") + 2 :].split()


def alive(pid: int) -> bool:
    """True for a running process. A zombie counts as gone: PID 1 here may reap late."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] not in ("Z", "X")


def identity(pid: int) -> str | None:
    """``"pid starttime"``: names one process for good (a bare pid can be reused)."""
    fields = _stat_fields(pid)
    return f"{pid} {fields[19]}" if fields and len(fields) > 19 else None


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields else None


def cmdline(pid: int) -> list[str]:
    try:
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def all_pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def with_descendants(pids: Iterable[int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        ppid = parent_of(pid)
        if ppid is not None:
            children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    queue = list(pids)
    while queue:
        pid = queue.pop()
        if pid not in found:
            found.add(pid)
            queue.extend(children.get(pid, []))
    return found


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid and pid not in pids:
        pids.add(pid)
        pid = parent_of(pid) or 0
    return pids


def pids_with_args(*args: str) -> set[int]:
    """Live processes whose command line contains every one of ``args`` (e.g. our conf path)."""
    return {pid for pid in all_pids() if alive(pid) and set(args) <= set(cmdline(pid))}


def _uses_dir(pid: int, root: str) -> bool:
    fd_dir = PROC / str(pid) / "fd"
    try:
        targets = [os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)]
    except OSError:
        return False
    return any(t.startswith(root + "/") for t in targets)


def _job_env_of(pid: int, conf_entry: bytes) -> bool:
    """A job task of this cluster: SLURM_CONF=<our conf> together with a SLURM_JOB_ID."""
    try:
        environ = (PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return conf_entry in environ and any(e.startswith(b"SLURM_JOB_ID=") for e in environ)


def cluster_pids(root: Path, conf: Path) -> set[int]:
    """Job processes of the cluster in ``root`` (not its daemons), whatever state those are in.

    Two marks, both specific to this cluster: a slurmstepd holding a file open under root (its
    node's log), and a process whose environment has SLURM_CONF=<conf> and a SLURM_JOB_ID (a job
    task that escaped its slurmstepd). A user's shell that merely exported SLURM_CONF is not
    matched. Our own process and its ancestors are excluded: the caller may run inside a job.
    """
    mine = _ancestors()
    conf_entry = f"SLURM_CONF={conf}".encode()
    owned = set()
    for pid in all_pids():
        if pid in mine:
            continue
        argv = cmdline(pid)
        stepd = bool(argv) and argv[0].startswith("slurmstepd")
        if (stepd and _uses_dir(pid, str(root))) or _job_env_of(pid, conf_entry):
            owned.add(pid)
    return {pid for pid in with_descendants(owned) if pid not in mine}


def wait_gone(pids: Iterable[int], timeout_s: float) -> set[int]:
    """Wait until none of ``pids`` is alive; returns those still alive at the deadline."""
    left = set(pids)

    def all_gone() -> bool:
        nonlocal left
        left = {p for p in left if alive(p)}
        return not left

    poll_until(all_gone, timeout_s, interval_s=0.05)
    return left


def terminate(pids: Iterable[int], grace_s: float = 5.0) -> set[int]:
    """SIGTERM, then SIGKILL whatever is left after ``grace_s``; returns pids that survived both."""
    targets = {p for p in pids if alive(p)}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        targets = wait_gone(targets, grace_s)
        if not targets:
            break
    return targets
