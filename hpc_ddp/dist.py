"""Start and stop the process group: the only module that calls ``init_process_group``.

Three things users hit on real clusters shape this module:

* A rank that never arrives (wrong MASTER_ADDR, firewalled port, a node that failed to start)
  makes ``init_process_group`` wait for its whole timeout, 30 minutes by default. We rendezvous
  through our own TCPStore first, with a short ``connect_timeout_s``, and name the missing ranks.
* One dead rank leaves the others blocked in a collective. NCCL's async error handling tears the
  communicator down; with Gloo the peers see a closed socket. Either way, bounded.
* Gloo processes sometimes abort in a C++ destructor at interpreter exit, after all work is done
  (often enough to matter, under every launcher: benchmarks/NOTES.md).
  ``shutdown_and_exit`` ends the group, flushes and leaves with ``os._exit`` so a finished
  job can never be turned into a failed one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from hpc_ddp.cluster import DistEnv, detect_env
from hpc_ddp.cluster.master_port import bind_failure_hint
from hpc_ddp.errors import HpcDdpError, LaunchEnvError
from hpc_ddp.network import choose_backend
from hpc_ddp.polling import poll_until

# NCCL reads these when the communicator is created; "3" = tear down on error and let the
# process exit instead of blocking the next collective forever.
_NCCL_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
_ARRIVED_KEY = "hpc_ddp/arrived"
_ALL_ARRIVED_KEY = "hpc_ddp/all_arrived"


@dataclass(frozen=True)
class DistContext:
    """What a training process needs after init: who it is, how it talks, where it computes."""

    env: DistEnv
    backend: str
    device: torch.device
    reason: str

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def devices(self) -> list[torch.device]:
        """All devices this process drives (several in the one-process-per-node layout)."""
        if self.device.type != "cuda":
            return [self.device]
        return [torch.device("cuda", g) for g in self.env.gpus]


def init_distributed(
    env: DistEnv | None = None,
    *,
    backend: str | None = None,
    timeout_s: float = 1800.0,
    connect_timeout_s: float = 120.0,
) -> DistContext:
    """Bind the device, rendezvous with a short deadline, then start the process group.

    A single process (world size 1) still gets a process group, so the trainer has one code path.
    """
    env = env or detect_env()
    device = process_device(env)
    cuda = device.type == "cuda"
    choice = choose_backend(cuda_available=cuda, requested=backend, env=env)
    for key, value in {**_NCCL_DEFAULTS, **choice.env}.items():
        os.environ.setdefault(key, value)  # a user's explicit setting always wins

    if cuda:
        torch.cuda.set_device(device)  # before init: NCCL binds its communicator to this device

    store = _rendezvous(env, connect_timeout_s)
    # Binding restricts NCCL to that one device: a process that drives several GPUs (model split
    # across them, DDP with device_ids=None) needs a communicator per device, so it must not bind.
    bind = choice.backend == "nccl" and len(env.gpus) == 1
    kwargs = {"device_id": device} if bind else {}
    dist.init_process_group(
        backend=choice.backend,
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,
    )
    if choice.backend == "gloo":
        # Gloo's init can return on one rank while a peer is still connecting to it; a rank that
        # then exits without a collective (a function with none, shutdown_and_exit) fails that
        # peer with "Connection closed by peer" (seen in tests/test_fn_executor.py). One
        # collective first: every rank is connected. NCCL's init is collective on every rank.
        dist.all_reduce(torch.zeros(1))
    return DistContext(env=env, backend=choice.backend, device=device, reason=choice.reason)


def process_device(env: DistEnv) -> torch.device:
    """The device ``init_distributed`` gives this process: its first GPU when CUDA works and
    the launcher assigned it GPUs, else the CPU. Creates no CUDA context."""
    if torch.cuda.is_available() and env.gpus:
        return torch.device("cuda", env.gpus[0])
    return torch.device("cpu")


def _agent_hosts_store(env: DistEnv) -> bool:
    """Whether torchrun's agent already serves the TCPStore at ``env``'s master address: then
    every rank, rank 0 too, is a client of it. A second server there cannot bind the agent's
    port; torch logs that as an error ("failed to bind") before it goes on as a client. The
    rule is torch's own (torch.distributed.rendezvous._create_c10d_store): the agent's flag,
    and the address being the one the agent exported with it."""
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("MASTER_ADDR") == env.master_addr
        and os.environ.get("MASTER_PORT") == str(env.master_port)
    )


def _rendezvous(env: DistEnv, connect_timeout_s: float) -> dist.TCPStore:
    """Meet every rank on rank 0's TCPStore (torchrun's agent's, where it hosts one) within
    ``connect_timeout_s``, or say who is missing."""
    where = f"{env.master_addr}:{env.master_port}"
    deadline = time.monotonic() + connect_timeout_s
    hosting = env.rank == 0 and not _agent_hosts_store(env)
    try:
        if not hosting:
            _wait_until_listening(env.master_addr, env.master_port, deadline)
        store = _open_store(env, deadline, hosting=hosting)
    except (RuntimeError, OSError) as err:
        if hosting:  # TCPStore's server fails at once (EADDRINUSE) when the port is taken
            origin = env.master_port_origin or "MASTER_PORT"
            raise LaunchEnvError(
                f"rank 0 could not listen on port {env.master_port} of {socket.gethostname()} "
                f"(port source: {origin}): {err}",
                hint=bind_failure_hint(env.master_port, origin),
            ) from err
        raise LaunchEnvError(
            f"rank {env.rank} on {socket.gethostname()} could not reach rank 0 at {where} "
            f"within {connect_timeout_s:.0f} s: {err}",
            hint="check that rank 0 started, that MASTER_ADDR resolves to its host from here "
            "and that the port is not firewalled (hpc-ddp env shows what each rank derived)",
        ) from err

    store.set(f"hpc_ddp/host/{env.rank}", socket.gethostname())
    if int(store.add(_ARRIVED_KEY, 1)) == env.world_size:
        store.set(_ALL_ARRIVED_KEY, "1")  # the last to arrive wakes everyone's wait below
    try:
        store.wait([_ALL_ARRIVED_KEY], timedelta(seconds=max(deadline - time.monotonic(), 1.0)))
    except RuntimeError as err:  # the deadline passed (or rank 0's store went away)
        missing = [r for r in range(env.world_size) if not store.check([f"hpc_ddp/host/{r}"])]
        raise LaunchEnvError(
            f"rank {env.rank}: after {connect_timeout_s:.0f} s, {len(missing)} of "
            f"{env.world_size} ranks never reached {where}: missing ranks {missing[:16]}",
            hint="a node or task failed to start, or ranks disagree on WORLD_SIZE/MASTER_ADDR;"
            " look at the missing ranks' logs first",
        ) from err
    return store


def _open_store(env: DistEnv, deadline: float, *, hosting: bool) -> dist.TCPStore:
    """The TCPStore server (``hosting``: rank 0's), or a client of it, within the deadline.

    A client that reaches a process which accepts connections but is no TCPStore (rank 0
    could not bind the port because that process holds it) waits for an answer forever,
    whatever its timeout (torch 2.14). So the client is built in a thread (the constructor
    releases the GIL) and abandoned at the deadline; run_main's os._exit ends the process
    with the thread still blocked.
    """
    timeout = timedelta(seconds=max(deadline - time.monotonic(), 1.0))

    def open_store() -> dist.TCPStore:
        return dist.TCPStore(
            env.master_addr,
            env.master_port,
            env.world_size,
            is_master=hosting,
            timeout=timeout,
            wait_for_workers=False,
        )

    if hosting:
        return open_store()
    result: list[dist.TCPStore | BaseException] = []
    thread = threading.Thread(
        target=lambda: result.append(_call(open_store)), name="hpc-ddp-store", daemon=True
    )
    thread.start()
    thread.join(max(deadline - time.monotonic(), 1.0))
    if not result:
        where = f"{env.master_addr}:{env.master_port}"
        raise LaunchEnvError(
            f"rank {env.rank} on {socket.gethostname()} connected to {where}, but no rank-0 "
            f"store answered there before the connect deadline: another process listens on "
            f"port {env.master_port} (port source: {env.master_port_origin or 'MASTER_PORT'})",
            hint="rank 0 could not bind that port, and its log says so; "
            f"`ss -ltnp 'sport = :{env.master_port}'` on {env.master_addr} names the holder",
        )
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _call(fn: Callable[[], dist.TCPStore]) -> dist.TCPStore | BaseException:
    try:
        return fn()
    except BaseException as err:  # handed to the waiting thread, which raises it
        return err


def _wait_until_listening(host: str, port: int, deadline: float) -> None:
    """Return once rank 0 accepts connections on host:port, polling far more often than
    TCPStore retries.

    TCPStore's client retries a refused connection only after a backoff (exponential, with
    jitter, starting at half a second), and ranks that finish starting a moment before rank 0 do
    meet a refusal: the backoff then lengthens a rank's start at random (benchmarks/NOTES.md).
    Other errors (a name that does not resolve, no route) are left for TCPStore to report.
    """

    def listening() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:
            return True

    if not poll_until(listening, deadline - time.monotonic(), interval_s=0.01):
        raise TimeoutError(f"nothing listened on {host}:{port}")


_exit_follows = False  # leave_group_to_exit: this process exits once its training is done


def leave_group_to_exit() -> None:
    """Declare that this process exits once its one training is done (the ``hpc-ddp train``
    worker, under every launcher): ``end_process_group`` then leaves an NCCL group to the exit.

    Not for a ``run_main`` entry point in general: one that trains twice needs the first group
    destroyed before the second starts.
    """
    global _exit_follows
    _exit_follows = True


# Objects whose ``close()`` must run before the group is destroyed (a captured step: ncclCommDestroy
# waits for ever for the resources of an all-reduce that a live CUDA graph holds). Weak, so a step
# that is collected drops out by itself; ``close`` is idempotent.
_close_first: weakref.WeakSet[Any] = weakref.WeakSet()


def close_before_end(holder: Any) -> None:
    """Have ``end_process_group`` call ``holder.close()`` before it destroys the group."""
    _close_first.add(holder)


def end_process_group(
    release: Callable[[], object] | None = None, *, exiting: bool = False
) -> None:
    """Destroy this process's group, calling ``release`` first (what must go before it, such as
    a graph's captured NCCL work), and ``close()`` of what ``close_before_end`` registered
    (a ``CapturedStep`` its script did not close).

    Where the process exits next (``exiting``: ``shutdown_and_exit``; or declared by
    ``leave_group_to_exit``), an NCCL group is left to the exit instead, once this GPU's queued
    work is done: its destroy is slow at several GPUs (benchmarks/NOTES.md) and frees nothing
    that the exit does not. Gloo's is still destroyed.
    """
    if (exiting or _exit_follows) and dist.get_backend() == "nccl":
        torch.cuda.synchronize()  # this rank's last collective has run; its peers' are theirs
        return
    if release is not None:
        release()
    for holder in list(_close_first):
        holder.close()
    dist.destroy_process_group()


def shutdown_and_exit(code: int = 0) -> NoReturn:
    """Leave without running C++ static destructors (the Gloo exit abort), flushing first."""
    if code == 0 and dist.is_available() and dist.is_initialized():
        try:
            end_process_group(exiting=True)
        except Exception as err:  # the work is done; a teardown hiccup must not fail the job
            print(f"hpc-ddp: warning: ending the process group failed: {err}", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe must not block exit
            stream.flush()
    os._exit(code)


def rank_prefix() -> str:
    """``[rank R/W host]`` from the process group if up, else from the launcher's variables."""
    if dist.is_available() and dist.is_initialized():
        rank, world = str(dist.get_rank()), str(dist.get_world_size())
    else:
        try:  # the same answer every launcher gets, before the process group exists
            env = detect_env()
            rank, world = str(env.rank), str(env.world_size)
        except HpcDdpError:  # the launch itself is what went wrong
            rank, world = "?", "?"
    return f"[rank {rank}/{world} {socket.gethostname()}]"


def _print_rank_traceback(err: BaseException) -> None:
    """``err``'s traceback, every line prefixed with ``rank_prefix()`` (ranks' logs are often
    merged into one file, where an unprefixed traceback belongs to nobody)."""
    prefix = rank_prefix()
    text = "".join(traceback.format_exception(err))
    sys.stderr.write("".join(f"{prefix} {line}\n" for line in text.splitlines()))
    sys.stderr.flush()


def error_exit_code(err: BaseException) -> int:
    """2 bad input (an HpcDdpError's own code), 130 Ctrl-C, 1 anything else (a crash)."""
    if isinstance(err, HpcDdpError):
        return err.exit_code
    return 130 if isinstance(err, KeyboardInterrupt) else 1


def report_error(err: BaseException) -> int:
    """Print ``err`` with this rank's prefix, once (a second call for the same error prints
    nothing), and return its exit code. ``Comm.check`` prints a rank's own error this way
    before the other ranks say that a peer failed, so the cause comes first in a merged log."""
    code = error_exit_code(err)
    if isinstance(err, HpcDdpError):
        text = f"{rank_prefix()} error: {err}"
    elif isinstance(err, KeyboardInterrupt):
        text = f"{rank_prefix()} interrupted"
    else:
        text = ""  # a crash: its traceback
    if not getattr(err, "_hpc_ddp_reported", False):
        if text:
            print(text, file=sys.stderr, flush=True)
        else:
            _print_rank_traceback(err)
        err._hpc_ddp_reported = True  # type: ignore[attr-defined]
    return code


def exit_code_of(main: Callable[[], int | None]) -> int:
    """Run ``main`` and turn whatever it raises into an exit code, printed with the rank.

    A failure on rank 5 of node 2 still reaches the user even though only rank 0 logs progress.
    """
    try:
        return int(main() or 0)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException as err:
        return report_error(err)


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Run a worker entry point and exit through ``shutdown_and_exit`` whatever happens.

    On error the process group is not destroyed (that can block on peers); the process exits
    and the peers' collectives fail.
    """
    shutdown_and_exit(exit_code_of(main))
