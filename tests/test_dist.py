"""hpc_ddp.dist with real processes and real Gloo: the rendezvous deadline, rank-named errors and
the exit path. Ranks get their places from the project's own launcher variables (HPC_DDP_*), as
``hpc-ddp launch`` sets them; all "nodes" are this machine.
"""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from trainer_helpers import Proc, fork_server, job_env, scratch_file, torchrun_cmd

from hpc_ddp.cluster.master_port import PORT_BASE, PORT_SPAN, derive_port, free_port

WORKER = Path(__file__).parent / "workers" / "dist_worker.py"


def _rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return job_env(
        HPC_DDP_STARTED_BY="pdsh",
        HPC_DDP_NODE_RANK="0",
        HPC_DDP_NUM_NODES="1",
        HPC_DDP_LOCAL_RANK=str(rank),
        HPC_DDP_LOCAL_WORLD_SIZE=str(world),
        HPC_DDP_MASTER_ADDR="127.0.0.1",
        HPC_DDP_MASTER_PORT=str(port),
    )


def _start(
    ranks: list[int], world: int, port: int, *args: str, fresh: bool = False
) -> list[tuple[Proc, Path]]:
    """The worker on each of ``ranks``, with its output file: forked from the tests' fork
    server (which imported torch), or with ``fresh`` each an interpreter of its own, for the
    exit path, where how a user's process ends (atexit, C++ destructors) is what is tested."""
    started = []
    for rank in ranks:
        out = scratch_file(f"rank{rank}-")
        env = _rank_env(rank, world, port)
        if fresh:
            with out.open("w") as log:
                cmd = [sys.executable, str(WORKER), *args]
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        else:
            proc = fork_server().start([str(WORKER), *args], out, env=env, script=True)
        started.append((proc, out))
    return started


def _finish(procs: list[tuple[Proc, Path]], timeout: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout
    results = []
    for proc, out in procs:
        try:
            code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for p, _ in procs:
                p.kill()
            raise AssertionError(f"a rank was still running after {timeout} s") from None
        results.append((code, out.read_text(errors="replace")))
    return results


def test_two_ranks_all_reduce_and_leave_without_running_exit_handlers() -> None:
    """The sum is right, both exit 0, and no atexit handler ran: run_main left through
    os._exit, past the point where Gloo's C++ destructors abort 10-30 % of processes here."""
    for _ in range(3):
        port = free_port()
        results = _finish(_start([0, 1], 2, port, fresh=True), timeout=120)
        for rank, (code, out) in enumerate(results):
            assert code == 0, out
            assert f"rank {rank} sum 3 backend gloo" in out, out
            assert "ATEXIT-RAN" not in out, out


def test_under_torchrun_every_rank_uses_the_agents_store_and_nothing_fails_to_bind() -> None:
    """torchrun's agent hosts the TCPStore at MASTER_ADDR:MASTER_PORT for its workers
    (TORCHELASTIC_USE_AGENT_STORE=True): rank 0 must be a client there too. A second server
    made torch print "[E ...] TCPStore ... failed to bind" on every launch, an alarm about
    nothing. Real torchrun, two real Gloo ranks."""
    done = subprocess.run(
        torchrun_cmd(2, [], script=str(WORKER)),
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank} sum 3 backend gloo" in done.stdout, done.stdout
    assert "failed to bind" not in done.stderr, done.stderr
    assert "[E" not in done.stderr, done.stderr  # no error line of torch's at all


def test_a_rank_that_never_arrives_is_named_within_the_connect_deadline() -> None:
    port = free_port()
    started = time.monotonic()
    [(code, out)] = _finish(_start([0], 2, port, "--connect-timeout-s", "3"), timeout=90)
    assert code == 2, out
    assert "1 of 2 ranks never reached 127.0.0.1" in out and "missing ranks [1]" in out, out
    assert "HINT:" in out
    assert time.monotonic() - started < 60  # seconds, not init_process_group's 30 minutes


def test_a_rank_that_cannot_reach_rank_0_says_so() -> None:
    port = free_port()  # nobody listens there
    [(code, out)] = _finish(_start([1], 2, port, "--connect-timeout-s", "3"), timeout=90)
    assert code == 2, out
    assert f"could not reach rank 0 at 127.0.0.1:{port}" in out, out
    assert "HINT:" in out


def test_an_exception_on_one_rank_is_named_and_the_other_rank_does_not_hang() -> None:
    port = free_port()
    (code0, out0), (code1, out1) = _finish(_start([0, 1], 2, port, "--mode", "raise"), 120)
    assert code1 == 1, out1
    assert "[rank 1/2" in out1 and "RuntimeError: rank 1 fails on purpose" in out1, out1
    assert code0 != 0, out0  # its all-reduce lost its peer: an error, not a hang


def test_a_user_error_exits_2_with_its_hint() -> None:
    [(code, out)] = _finish(_start([0], 1, free_port(), "--mode", "usage"), timeout=60)
    assert code == 2, out
    assert "error: --mode usage was asked for" in out and "HINT: this is what a hint" in out
    assert "[rank 0/1 " in out, out  # named from the launcher's variables: no group exists yet


def test_a_rank_waits_for_rank_0_to_listen_and_returns_once_it_does() -> None:
    """Ranks > 0 poll rank 0's port themselves (TCPStore's own retry after a refusal comes
    250-750 ms later); while nothing listens they keep waiting, until their deadline."""
    from hpc_ddp.dist import _wait_until_listening

    port = free_port()
    with pytest.raises(TimeoutError, match=f"nothing listened on 127.0.0.1:{port}"):
        _wait_until_listening("127.0.0.1", port, time.monotonic() + 0.2)

    returned = threading.Event()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            _wait_until_listening("127.0.0.1", port, time.monotonic() + 60)
            returned.set()
        except BaseException as err:
            errors.append(err)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    assert not returned.wait(0.3) and not errors  # refused, refused, ...: still waiting
    with socket.create_server(("127.0.0.1", port)):
        assert returned.wait(30), "the waiter did not notice the listener"
    waiter.join(30)
    assert not errors


def _held_port(lo: int = 20000, hi: int = 29000) -> tuple[socket.socket, int]:
    """A real listener on a port of [lo, hi) that nobody else holds (all "nodes" are here)."""
    start = random.randrange(lo, hi)
    for offset in range(hi - lo):
        port = lo + (start - lo + offset) % (hi - lo)
        try:
            return socket.create_server(("0.0.0.0", port)), port
        except OSError:
            continue
    raise AssertionError(f"no free port in [{lo}, {hi})")


def _bind_failure_env(origin: str, port: int) -> dict[str, str]:
    """One rank whose MASTER_PORT comes from ``origin``. The Slurm variables are written here
    for a one-task job (the real srun with reserved ports is in test_slurm_env.py)."""
    if origin == "MASTER_PORT":
        return job_env(MASTER_PORT=str(port))
    job_id = str(port - PORT_BASE + 3 * PORT_SPAN)  # derive_port(job_id) == port
    if origin == "derived from job id":
        return job_env(SLURM_JOB_ID=job_id, SLURM_NTASKS="1", SLURM_JOB_NUM_NODES="1")
    return job_env(
        SLURM_JOB_ID=job_id,
        SLURM_STEP_ID="0",
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_STEP_NUM_TASKS="1",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_TASKS_PER_NODE="1",
        SLURM_STEP_NODELIST="localhost",
        SLURM_STEP_RESV_PORTS=f"{port}-{port + 2}",
    )


@pytest.mark.parametrize("origin", ["MASTER_PORT", "derived from job id", "SLURM_STEP_RESV_PORTS"])
def test_rank_0_that_cannot_bind_its_port_fails_in_seconds_naming_port_origin_and_fix(
    origin: str,
) -> None:
    """A real listener holds the port; a real one-rank Gloo init through hpc_ddp.dist must end
    with exit 2 long before its 60 s connect deadline, saying which port, where it came from
    and what to do about it."""
    squatter, port = _held_port()
    with squatter:
        assert derive_port(str(port - PORT_BASE + 3 * PORT_SPAN)) == port
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, str(WORKER), "--connect-timeout-s", "60"],
            env=_bind_failure_env(origin, port),
            capture_output=True,
            text=True,
            timeout=60,
        )
        took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert f"rank 0 could not listen on port {port} of {socket.gethostname()}" in out, out
    assert f"(port source: {origin}" in out, out
    assert "EADDRINUSE" in out and f"ss -ltnp 'sport = :{port}'" in out, out
    hint = next(line for line in out.splitlines() if line.startswith("HINT:"))
    assert "MASTER_PORT=<a free port>" in hint or "set MASTER_PORT to a free port" in hint, hint
    assert took < 30, f"{took:.1f} s: the failure must not wait for the connect deadline"


def test_a_rank_that_reaches_a_stray_listener_instead_of_rank_0_fails_at_its_deadline() -> None:
    """Rank 0 cannot bind the port a real stray listener holds; rank 1 connects to that
    listener, which never answers as a store would. TCPStore's client waited there forever,
    whatever its timeout; now rank 1 gives up at its 5 s connect deadline, saying why."""
    squatter, port = _held_port()
    with squatter:
        started = time.monotonic()
        results = _finish(_start([0, 1], 2, port, "--connect-timeout-s", "5"), timeout=90)
        took = time.monotonic() - started
    (code0, out0), (code1, out1) = results
    assert code0 == 2 and f"rank 0 could not listen on port {port}" in out0, out0
    assert code1 == 2, out1
    assert f"connected to 127.0.0.1:{port}, but no rank-0 store answered" in out1, out1
    assert "port source: HPC_DDP_MASTER_PORT" in out1 and "HINT: rank 0 could not bind" in out1
    assert took < 60, f"{took:.1f} s"


_END_GROUP = r"""
import sys

import torch
import torch.distributed as dist

import hpc_ddp.dist as hdist

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
# NCCL needs a GPU, which this machine lacks: the Gloo group is reported as NCCL's and the GPU
# sync is recorded instead of run.
calls = []
gloo_backend = dist.get_backend
dist.get_backend = lambda group=None: "nccl"
torch.cuda.synchronize = lambda device=None: calls.append("synchronize")
if sys.argv[1] == "exit-follows":
    hdist.leave_group_to_exit()
hdist.end_process_group(release=lambda: calls.append("release"))
dist.get_backend = gloo_backend
print(calls, dist.is_initialized(), flush=True)
hdist.shutdown_and_exit(0)
"""


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("api", "['release'] False"), ("exit-follows", "['synchronize'] True")],
)
def test_an_nccl_group_is_left_to_the_exit_only_where_the_worker_declared_it(
    mode: str, expected: str
) -> None:
    """``train()`` from the API destroys its group (releasing captured work first), so a second
    training can start one; the ``hpc-ddp train`` worker, which exits next, only waits for its
    GPU and leaves the group to the exit."""
    out = subprocess.run(
        [sys.executable, "-c", _END_GROUP, mode], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected, out.stdout + out.stderr
