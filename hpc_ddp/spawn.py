"""Start one node's processes by fork, after the imports: ``hpc-ddp train --nproc-per-node N``.

torchrun starts a fresh interpreter per worker, and each then imports torch and the trainer: seconds
of torchrun's own start, then of interpreter and imports, before any work (benchmarks/NOTES.md).
Forking once the parent has imported them, and before anything touched CUDA, hands every worker
those modules for free. The parent then only supervises:

* it forwards the signals a scheduler sends (preemption, time limit, Ctrl-C) to every worker,
  from the first fork on: a signal while the workers are being forked stops the forking;
* when a worker fails it stops the others (SIGTERM, then SIGKILL after a grace period), so a dead
  rank never leaves its peers waiting in a collective, and exits with the failed worker's code;
  when the worker left on a signal forwarded to all, only the grace period runs. The exits the
  ranks agree on (exit_codes.AGREED_EXITS: 75 requeued, 65 diverged) are no failure: every
  worker leaves with that code by itself, and so does the parent;
* workers die with it (PR_SET_PDEATHSIG), so a killed parent leaves no orphans on the GPUs.

N is bounded before anything starts by what the machine can run: the visible GPUs, else
CPU_WORKERS_PER_CORE per CPU core this process may use (``MAX_NPROC_VAR`` overrides that),
and always the descriptors the parent may open (it watches each worker through one).

Workers see the launch contract of the "spawn" starter (hpc_ddp.env_vars, read back by
hpc_ddp.cluster.launch_contract) plus the standard RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/
MASTER_PORT, like torchrun's workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import selectors
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hpc_ddp.cluster import detect_env
from hpc_ddp.cluster._vars import get_opt_int
from hpc_ddp.cluster.devices import count_visible_gpus, resolve_gpus_per_process
from hpc_ddp.cluster.master_port import free_port, parse_port
from hpc_ddp.env_vars import MAX_NPROC_VAR, launch_environ
from hpc_ddp.errors import ConfigError
from hpc_ddp.exit_codes import AGREED_EXITS, EXIT_DIVERGED, EXIT_REQUEUE

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
GRACE_S = 10.0  # after a worker failed: how long the others get to leave before SIGKILL
_PR_SET_PDEATHSIG = 1
# Workers per CPU core on a machine without GPUs: enough to rehearse a distributed job on a
# laptop, few enough that a typo (1000 for 10) is refused instead of forking until the machine
# stalls.
CPU_WORKERS_PER_CORE = 4
# Descriptors the parent keeps for itself besides the one per worker it watches.
_FD_RESERVE = 32


def worker_environ(rank: int, nproc: int, port: int, gpus_per_process: int) -> dict[str, str]:
    """The variables one worker gets: the launch contract (hpc_ddp.cluster.launch_contract reads it)
    and torch's own."""
    return {
        **launch_environ(
            started_by="spawn",
            gpus_per_process=gpus_per_process,
            num_nodes=1,
            node_rank=0,
            local_rank=rank,
            local_world_size=nproc,
            master_addr="127.0.0.1",
            master_port=port,
        ),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
    }


def check_can_spawn(nproc: int, gpus_per_process: int, environ: Mapping[str, str]) -> None:
    """Refuse, before anything starts, what would only fail later inside the workers."""
    if nproc < 1:
        raise ConfigError(
            f"--nproc-per-node {nproc}: must be at least 1",
            hint="give the number of processes to start on this machine (one per GPU)",
        )
    outer = detect_env(environ, gpus_per_process=gpus_per_process)
    if outer.world_size > 1:
        raise ConfigError(
            f"--nproc-per-node {nproc}, but this process is already rank {outer.rank} of "
            f"{outer.world_size} started by {outer.source}",
            hint="let one launcher start the processes: drop --nproc-per-node under "
            "srun/torchrun/mpirun/hpc-ddp launch, or start a single hpc-ddp train",
        )
    gpus = count_visible_gpus(environ)
    if gpus and nproc * gpus_per_process > gpus:
        raise ConfigError(
            f"--nproc-per-node {nproc} x {gpus_per_process} GPU(s) per process needs "
            f"{nproc * gpus_per_process} GPUs, but {gpus} are visible",
            hint=f"use --nproc-per-node {max(gpus // gpus_per_process, 1)} or fewer "
            "(CUDA_VISIBLE_DEVICES decides which GPUs are visible)",
        )
    if not gpus:
        _check_cpu_workers(nproc, environ)
    _check_descriptors(nproc)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        # A forked child cannot use a CUDA context its parent created.
        raise ConfigError(
            "CUDA was initialised before the workers were forked",
            hint="call hpc_ddp.spawn.launch before any torch.cuda call in this process",
        )


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity: a Slurm step's or taskset's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call on this platform
        return os.cpu_count() or 1


def _check_cpu_workers(nproc: int, environ: Mapping[str, str]) -> None:
    """Without GPUs, at most CPU_WORKERS_PER_CORE workers per usable core, or what
    MAX_NPROC_VAR allows."""
    allowed = get_opt_int(environ, MAX_NPROC_VAR, minimum=1)
    if allowed is not None:
        limit, why = allowed, f"{MAX_NPROC_VAR}={allowed}"
    else:
        cores = usable_cores()
        limit = CPU_WORKERS_PER_CORE * cores
        why = f"{CPU_WORKERS_PER_CORE} per CPU core, {cores} core(s) usable here"
    if nproc > limit:
        raise ConfigError(
            f"--nproc-per-node {nproc}: more workers than this machine without GPUs runs "
            f"(at most {limit}: {why})",
            hint=f"use --nproc-per-node {limit} or fewer; to fork more, set {MAX_NPROC_VAR} to "
            "the most this machine should run (each worker is a whole process)",
        )


def _check_descriptors(nproc: int) -> None:
    """The parent watches each worker through a descriptor (a pidfd): they must fit under its
    limit on open files, with the ones it holds already."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: count the reserve only
        held = 0
    if nproc + held + _FD_RESERVE > soft:
        raise ConfigError(
            f"--nproc-per-node {nproc}: the parent watches each worker through an open file, "
            f"and this process may open only {soft} ({held} open already)",
            hint=f"raise the limit (`ulimit -n {nproc + held + _FD_RESERVE}` or more) or start "
            f"at most {max(soft - held - _FD_RESERVE, 1)} workers",
        )


@dataclass
class _Supervisor:
    pids: dict[int, int]  # pid -> rank
    codes: dict[int, int] = field(default_factory=dict)  # rank -> exit code
    failed: int | None = None  # the first rank that failed
    kill_at: float = float("inf")
    forwarded: signal.Signals | None = None  # the last signal every worker got from us

    def forward(self, signum: int, _frame: object) -> None:
        self.forwarded = signal.Signals(signum)
        for pid, rank in self.pids.items():
            if rank not in self.codes:
                _signal(pid, signum)

    def stop_others(self, code: int) -> str:
        """Make the workers still running leave (SIGKILL after the grace period) after one
        exited with ``code``; says how."""
        self.kill_at = time.monotonic() + GRACE_S
        others = len(self.pids) - len(self.codes)
        sig = self.forwarded
        if sig is not None and code in (-sig, 128 + sig):  # killed by it, or left as Ctrl-C's 130
            # It left on the signal we forwarded, which the others got too: they are leaving on
            # their own, and a SIGTERM could end one before it recorded why it stopped (when
            # TERM is not a requeue signal).
            return f"the other {others} worker(s) got {sig.name} too"
        for pid, rank in self.pids.items():
            if rank not in self.codes:
                _signal(pid, signal.SIGTERM)
        return f"stopping the other {others} worker(s)"

    def reap(self, pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        rank = self.pids[pid]
        code = os.waitstatus_to_exitcode(status)  # -N: killed by signal N
        self.codes[rank] = code
        if code not in (0, *AGREED_EXITS) and self.failed is None:
            self.failed = rank
            stopping = self.stop_others(code)
            print(
                f"hpc-ddp spawn: rank {rank} (pid {pid}) {_describe(code)}; {stopping}",
                file=sys.stderr,
                flush=True,
            )

    def exit_code(self) -> int:
        if self.failed is not None:
            code = self.codes[self.failed]
            return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell
        for agreed in (EXIT_DIVERGED, EXIT_REQUEUE):
            if agreed in self.codes.values():
                return agreed
        return 0


def _describe(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _signal(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone; reaped later
        os.kill(pid, signum)


def die_with_parent(parent: int) -> None:
    """In a child of ``parent``: SIGKILL when the parent dies (or exit now if it already has).
    The trainer's processes leave through ``os._exit``, which runs no cleanup of children."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _become_worker(
    rank: int, nproc: int, port: int, gpp: int, parent: int, mask: set[signal.Signals]
) -> None:
    """In the child, right after fork: die with the parent, default signals, own variables."""
    die_with_parent(parent)
    for signum in FORWARDED:
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # what launch() blocked around the fork
    os.environ.update(worker_environ(rank, nproc, port, gpp))
    _share_cpu_threads(nproc)


def _share_cpu_threads(nproc: int) -> None:
    """One CPU thread per worker unless OMP_NUM_THREADS says otherwise, as torchrun does: N
    workers each running a thread per core would oversubscribe the machine N times (GPU runs
    barely use them). torch read OMP_NUM_THREADS when the parent imported it, so tell it too,
    whatever the count: set here, torch's thread pools are made before anything in the worker
    forks; left to be made later, they could fail torch's own fork handler at teardown and end
    the worker before it named a lost rank."""
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        os.environ["OMP_NUM_THREADS"] = "1"  # for anything the worker starts
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def launch(
    worker: Callable[[], object],
    nproc: int,
    *,
    gpus_per_process: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """Fork ``nproc`` workers running ``worker()`` (which must leave through ``os._exit``, as
    ``hpc_ddp.dist.run_main`` does); supervise them; return the job's exit code.

    ``gpus_per_process`` None: what ``environ`` says, else 1 (resolve_gpus_per_process); the
    workers are told the value, so that their own detect_env agrees."""
    environ = os.environ if environ is None else environ
    gpp = resolve_gpus_per_process(gpus_per_process, environ)
    check_can_spawn(nproc, gpp, environ)
    port = parse_port(environ["MASTER_PORT"]) if environ.get("MASTER_PORT") else free_port()
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()  # or the children print the parent's buffered text again
    sup = _Supervisor({})
    # The handlers are in before the first fork: a signal that comes while the workers are
    # forked (a time limit, `timeout`, Ctrl-C during a slow start) reaches the parent at once,
    # goes to the workers forked so far, and no more are forked.
    previous = {signum: signal.signal(signum, sup.forward) for signum in FORWARDED}
    try:
        cut_short_by = _fork_all(sup, worker, nproc, port, gpp, parent)
        if cut_short_by is not None:
            sup.kill_at = time.monotonic() + GRACE_S  # they wait for ranks that never come
            print(
                f"hpc-ddp spawn: got {cut_short_by.name} while starting the workers: started "
                f"{len(sup.pids)} of {nproc}, which got it too; forking no more",
                file=sys.stderr,
                flush=True,
            )
        code = _supervise(sup)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    # A job whose start was cut short never ran: it ends as the signal ends a process.
    return code if cut_short_by is None else 128 + cut_short_by


def _fork_all(
    sup: _Supervisor,
    worker: Callable[[], object],
    nproc: int,
    port: int,
    gpp: int,
    parent: int,
) -> signal.Signals | None:
    """Fork the workers in rank order, unless a signal comes first: then the signal, with the
    workers forked so far."""
    for rank in range(nproc):
        if sup.forwarded is not None:
            return sup.forwarded
        _fork_worker(sup, worker, rank, nproc, port, gpp, parent)
    return None


def _fork_worker(
    sup: _Supervisor,
    worker: Callable[[], object],
    rank: int,
    nproc: int,
    port: int,
    gpp: int,
    parent: int,
) -> None:
    """Fork ``rank``'s worker and record it. Signals wait (blocked) across this one fork only:
    the child must not run the parent's handlers before it has its own, and the parent's
    handler must find the new worker recorded."""
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        pid = os.fork()
        if pid == 0:
            try:
                # The children get their own process group: a terminal's Ctrl-C reaches the
                # parent only, which forwards it once.
                os.setpgid(0, 0)
                _become_worker(rank, nproc, port, gpp, parent, mask)
                worker()
            finally:
                os._exit(1)  # the worker returned or raised instead of exiting: a bug
        sup.pids[pid] = rank
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a pending signal is handled now


def _supervise(sup: _Supervisor) -> int:
    """Reap the workers as they exit, SIGKILL those still running at ``sup.kill_at``; the
    job's exit code. Each worker is watched through a pidfd, with epoll (selectors): select()
    cannot watch a descriptor numbered above 1023, which a parent of ~1000 workers holds."""
    with selectors.DefaultSelector() as watched:
        try:
            for pid in sup.pids:
                watched.register(os.pidfd_open(pid), selectors.EVENT_READ, pid)
            while len(sup.codes) < len(sup.pids):
                timeout = (
                    None if sup.kill_at == float("inf") else max(sup.kill_at - time.monotonic(), 0)
                )
                ready = watched.select(timeout)
                for key, _ in ready:
                    watched.unregister(key.fd)
                    os.close(key.fd)
                    sup.reap(key.data)
                if not ready and time.monotonic() >= sup.kill_at:
                    for key in watched.get_map().values():
                        _signal(key.data, signal.SIGKILL)
                    sup.kill_at = float("inf")
        finally:
            for key in list(watched.get_map().values()):
                watched.unregister(key.fd)
                os.close(key.fd)
    return sup.exit_code()
