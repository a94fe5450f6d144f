"""Helpers for the ``hpc-ddp launch`` tests: run the real CLI, pdsh, clush, torchrun, Gloo.

A second physical host cannot exist here, so the tests use pdsh's and clush's ``exec`` workers:
"node0" and "node1" are names, each host's command runs on this machine, and the master
address is 127.0.0.1 (the launch's default for ``--rcmd exec``). For the ssh path, a fake
``ssh`` on PATH runs the command through a local shell, in a fresh environment, as sshd would
hand it to the user's login shell: that exercises the extra quoting layer and proves the launch
exports what the job needs instead of inheriting it. It can also play an unreachable host (exit
255, ssh's own code).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.cluster.master_port import free_port
from hpc_ddp.localslurm import wait_for

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv"
HPC_DDP = [str(VENV / "bin" / "python"), "-m", "hpc_ddp.cli"]
SETUP = f"source {VENV}/bin/activate"
WORKER = str(REPO / "tests" / "workers" / "allreduce_worker.py")

FAKE_SSH = """#!/bin/sh
# Test stand-in for ssh: skip options, take the host, run the rest through a shell like sshd.
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1; shift
case " ${FAKE_SSH_UNREACHABLE:-} " in
  *" $host "*) echo "ssh: connect to host $host port 22: Connection refused" >&2; exit 255 ;;
esac
# sshd gives the command a fresh login environment, not the caller's: so does this.
exec env -i HOME="$HOME" PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 /bin/sh -c "$*"
"""


def new_id(prefix: str = "t") -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def fake_ssh_dir(tmp: Path) -> Path:
    bin_dir = tmp / "fakebin"
    bin_dir.mkdir(exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    return bin_dir


@dataclass
class Launch:
    launch_id: str
    state_dir: Path
    base: list[str]  # CLI args up to (not including) '--'

    def stop_args(self, via: str = "pdsh", rcmd: str = "exec") -> list[str]:
        return [
            "launch",
            "stop",
            "--via",
            via,
            "--rcmd",
            rcmd,
            "--hosts",
            "node[0-1]",
            "--launch-id",
            self.launch_id,
            "--state-dir",
            str(self.state_dir),
            "--stop-grace",
            "3",
        ]


def launch_args(
    tool: str,
    tmp: Path,
    *,
    mode: str = "processes",
    gpus_per_node: int = 1,
    rcmd: str = "exec",
    hosts: str = "node[0-1]",
    extra: tuple[str, ...] = (),
) -> Launch:
    launch_id = new_id()
    state_dir = tmp / "state"
    base = [
        "launch",
        tool,
        "--rcmd",
        rcmd,
        "--hosts",
        hosts,
        "--mode",
        mode,
        "--gpus-per-node",
        str(gpus_per_node),
        "--master-port",
        str(free_port()),
        "--launch-id",
        launch_id,
        "--state-dir",
        str(state_dir),
        "--setup",
        SETUP,
        "--workdir",
        str(tmp),
        "--stop-grace",
        "3",
        *extra,
    ]
    return Launch(launch_id, state_dir, base)


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def hpc_ddp(args: list[str], *, timeout: float = 120, env: dict[str, str] | None = None) -> Result:
    start = time.monotonic()
    proc = subprocess.run(
        [*HPC_DDP, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start)


def json_by_host(stdout: str) -> dict[str, list[dict]]:
    """JSON objects per host. A host's processes share one pipe, and unbuffered Python
    (PYTHONUNBUFFERED=1) prints text and newline in two writes: two objects can share a line."""
    by_host: dict[str, list[dict]] = {}
    decoder = json.JSONDecoder()
    for line in stdout.splitlines():
        host, _, rest = line.partition(": ")
        while rest.startswith("{"):
            obj, end = decoder.raw_decode(rest)
            by_host.setdefault(host, []).append(obj)
            rest = rest[end:].lstrip()
    return by_host


def processes_of(launch_id: str) -> list[int]:
    """Live (non-zombie) processes started by this launch, found by their environment marker."""
    marker = f"HPC_DDP_LAUNCH_ID={launch_id}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            pids.append(int(entry.name))
    return pids


def assert_no_processes_left(launch_id: str, timeout: float = 10.0) -> None:
    wait_for(lambda: not processes_of(launch_id), timeout, f"processes of {launch_id} to end")


def kill_leftovers(launch_id: str) -> None:
    """Teardown safety net: a failed assertion must not leave a test's job running."""
    for pid in processes_of(launch_id):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def popen_hpc_ddp(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*HPC_DDP, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def python() -> str:
    return sys.executable
