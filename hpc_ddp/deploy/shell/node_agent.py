"""The node agent of ``hpc-ddp launch --mode processes``: one host's G processes, no torchrun.

``python -m hpc_ddp.deploy.shell.node_agent --nproc G -- CMD ...`` starts CMD G times, adding
the local rank 0..G-1 and the local world size G of the launch contract (hpc_ddp.env_vars) to
its environment (the host script exported the rest), and torch's env:// variables derived from
them, so that a script written for torchrun runs unchanged. If one process fails, the agent stops
its siblings (SIGTERM, SIGKILL after ``--grace`` seconds) and exits with that process's code, so
a dead rank ends the host at once instead of leaving the others blocked in a collective.

Pure standard library (and hpc_ddp.env_vars and hpc_ddp.cluster, which are too): it runs on
hosts before anything else is known to work.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from hpc_ddp.cluster import torch_contract
from hpc_ddp.env_vars import NODE_RANK_VAR, launch_environ
from hpc_ddp.errors import LaunchEnvError

TAG = "hpc-ddp node-agent:"


def exit_code(status: int) -> int:
    """A waitpid status as a shell would report it: code, or 128 + signal number."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _stop(procs: dict[int, tuple[int, subprocess.Popen[bytes]]], grace_s: float) -> None:
    """SIGTERM every live child, wait up to grace_s for them, then SIGKILL the rest."""
    for _, proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for _, proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run(nproc: int, command: list[str], grace_s: float) -> int:
    host = os.uname().nodename
    node_rank = int(os.environ.get(NODE_RANK_VAR, "0"))
    procs: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}
    for local_rank in range(nproc):
        env = {**os.environ, **launch_environ(local_rank=local_rank, local_world_size=nproc)}
        try:
            env.update(torch_contract(env))
            proc = subprocess.Popen(command, env=env)
        except LaunchEnvError as err:
            print(f"{TAG} {err}", file=sys.stderr, flush=True)
            _stop(procs, grace_s)
            return 2
        except OSError as err:
            print(f"{TAG} cannot start {command[0]!r}: {err}", file=sys.stderr, flush=True)
            _stop(procs, grace_s)
            return 127
        procs[proc.pid] = (local_rank, proc)

    # Signals meant for the job (the host script's trap, a stop) go to every child.
    def forward(signum: int, _frame: FrameType | None) -> None:
        for _, proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    remaining = set(procs)
    while remaining:
        # Blocks until *some* child exits: the first failure is seen at once, no polling.
        pid, status = os.wait()
        if pid not in remaining:
            continue
        remaining.discard(pid)
        local_rank, proc = procs[pid]
        proc.returncode = code = exit_code(status)  # we reaped it; tell Popen
        if code != 0:
            rank = node_rank * nproc + local_rank
            print(
                f"{TAG} local rank {local_rank} (rank {rank}) on {host} exited with code {code};"
                f" stopping the other {len(remaining)} process(es) of this host",
                file=sys.stderr,
                flush=True,
            )
            _stop(procs, grace_s)
            return code
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.deploy.shell.node_agent")
    parser.add_argument("--nproc", type=int, required=True, help="processes to start here")
    parser.add_argument("--grace", type=float, default=10.0, help="SIGTERM -> SIGKILL seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nproc < 1 or not command:
        parser.error("need --nproc >= 1 and a command after --")
    return run(args.nproc, command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
