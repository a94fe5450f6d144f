"""``hpc-ddp launch`` end to end: real pdsh, real clush, real torchrun, real multi-process Gloo.

No second physical host exists here: the two "hosts" node0/node1 are run by pdsh's and clush's
``exec`` workers on this machine (the master address is 127.0.0.1, the launch's default for
``--rcmd exec``). The ssh path uses a fake ``ssh`` on PATH that runs the command through a
local shell as sshd would, or plays an unreachable host (see launch_support).
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from launch_support import (
    SETUP,
    WORKER,
    Launch,
    assert_no_processes_left,
    fake_ssh_dir,
    hpc_ddp,
    json_by_host,
    launch_args,
    popen_hpc_ddp,
    processes_of,
)

import hpc_ddp as api
from hpc_ddp.localslurm import procs, wait_for

TOOLS = ("pdsh", "clush")
BOUND_S = 60  # a failed launch must end well within this (torchrun alone would wait 300 s)


@pytest.mark.parametrize("mode", ["processes", "torchrun"])
@pytest.mark.parametrize("tool", TOOLS)
def test_env_on_two_hosts(tool: str, mode: str, tmp_path: Path, launches: list[Launch]) -> None:
    """Node rank = position in sorted order, one master, world = hosts x processes."""
    launch = launch_args(tool, tmp_path, mode=mode, gpus_per_node=2, hosts="node1,node0")
    launches.append(launch)
    res = hpc_ddp([*launch.base, "--", "hpc-ddp", "env", "--json"])
    assert res.returncode == 0, res.stderr
    by_host = json_by_host(res.stdout)
    assert sorted(by_host) == ["node0", "node1"]
    ranks = []
    for node_rank, host in enumerate(["node0", "node1"]):
        for env in by_host[host]:
            assert env["node_rank"] == node_rank
            assert env["num_nodes"] == 2 and env["world_size"] == 4
            assert env["master_addr"] == "127.0.0.1"
            assert env["source"] == (tool if mode == "processes" else "torchrun")
            assert env["rank"] == node_rank * 2 + env["local_rank"]
            ranks.append(env["rank"])
    assert sorted(ranks) == [0, 1, 2, 3]
    assert len({e["master_port"] for envs in by_host.values() for e in envs}) == 1
    assert "all 2 host(s) finished with exit code 0" in res.stderr
    assert not (launch.state_dir / launch.launch_id).exists()  # pid files and dir cleaned up
    assert_no_processes_left(launch.launch_id)


@pytest.mark.parametrize("rcmd", ["exec", "ssh"])
@pytest.mark.parametrize("tool", TOOLS)
def test_quoting_survives_every_layer(
    tool: str, rcmd: str, tmp_path: Path, launches: list[Launch]
) -> None:
    """Spaces, quotes, $, and % (pdsh/clush placeholders) reach the process unchanged."""
    tricky = """a b'c"d $HOME %n %h 100%"""
    launch = launch_args(tool, tmp_path, rcmd=rcmd, extra=("--env", f"TRICKY={tricky}"))
    launches.append(launch)
    env = {"PATH": f"{fake_ssh_dir(tmp_path)}:{os.environ['PATH']}"}
    code = "import os, sys; print('GOT', repr(os.environ['TRICKY']), sys.argv[1:])"
    res = hpc_ddp([*launch.base, "--", "python3", "-c", code, "x y", "%n"], env=env)
    assert res.returncode == 0, res.stderr
    expected = f"GOT {tricky!r} ['x y', '%n']"
    assert sorted(res.stdout.splitlines()) == [f"node0: {expected}", f"node1: {expected}"]


@pytest.mark.parametrize("tool", TOOLS)
def test_remote_shell_gets_exactly_the_exported_env(
    tool: str, tmp_path: Path, launches: list[Launch]
) -> None:
    """Over ssh nothing is inherited: NCCL_*/GLOO_*/PYTHONPATH/OMP_NUM_THREADS are forwarded
    explicitly, --env is exported, other local variables do not leak, --setup activates the venv."""
    launch = launch_args(tool, tmp_path, rcmd="ssh", extra=("--env", "EXTRA=1"))
    launches.append(launch)
    env = {
        "PATH": f"{fake_ssh_dir(tmp_path)}:{os.environ['PATH']}",
        "NCCL_DEBUG": "INFO",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONPATH": "/opt/extra",
        "OMP_NUM_THREADS": "3",
        "LOCAL_ONLY": "leak",
    }
    names = ["NCCL_DEBUG", "GLOO_SOCKET_IFNAME", "PYTHONPATH", "OMP_NUM_THREADS", "EXTRA",
             "LOCAL_ONLY", "VIRTUAL_ENV"]  # fmt: skip
    code = f"import os, json; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    res = hpc_ddp([*launch.base, "--", "python3", "-c", code], env=env)
    assert res.returncode == 0, res.stderr
    seen = json_by_host(res.stdout)
    assert sorted(seen) == ["node0", "node1"]
    for (got,) in seen.values():
        assert got["NCCL_DEBUG"] == "INFO" and got["GLOO_SOCKET_IFNAME"] == "lo"
        assert got["PYTHONPATH"] == "/opt/extra" and got["OMP_NUM_THREADS"] == "3"
        assert got["EXTRA"] == "1" and got["LOCAL_ONLY"] is None
        assert got["VIRTUAL_ENV"] == str(Path(SETUP.split()[-1]).parents[1])


@pytest.mark.parametrize(("tool", "mode"), [("pdsh", "torchrun"), ("clush", "processes")])
def test_failing_rank_stops_the_others(
    tool: str, mode: str, tmp_path: Path, launches: list[Launch]
) -> None:
    """Gloo rank 1 (node1) exits 1 while rank 0 (node0) would sleep forever: the launch must stop
    node0, exit non-zero and name node1, in bounded time."""
    launch = launch_args(tool, tmp_path, mode=mode)
    launches.append(launch)
    out = tmp_path / "out"
    cmd = ["python3", WORKER, "--out", str(out), "--fail-rank", "1", "--hang-rank", "0"]
    res = hpc_ddp([*launch.base, "--", *cmd], timeout=BOUND_S + 30)
    assert res.returncode == 1, res.stderr
    assert res.seconds < BOUND_S, res.stderr
    assert "host node1 failed" in res.stderr, res.stderr
    assert "FAILED on node1" in res.stderr
    assert (out / "hanging-0").exists()  # node0 really was running when it got stopped
    assert_no_processes_left(launch.launch_id)


# Node rank 1 exits 3 at once; node rank 0 would sleep 10 minutes. GROUP_RANK is torchrun's.
ONE_HOST_FAILS = ["bash", "-c", 'r=${HPC_DDP_NODE_RANK:-$GROUP_RANK}; [ "$r" = 1 ] && exit 3; '
                  "exec sleep 600"]  # fmt: skip


@pytest.mark.parametrize(("tool", "mode"), [("pdsh", "processes"), ("clush", "torchrun")])
def test_failing_host_stops_the_others(
    tool: str, mode: str, tmp_path: Path, launches: list[Launch]
) -> None:
    """The same with a plain command (no torch in the workers): exit 3 on node1."""
    launch = launch_args(tool, tmp_path, mode=mode)
    launches.append(launch)
    res = hpc_ddp([*launch.base, "--", *ONE_HOST_FAILS], timeout=BOUND_S + 30)
    code = 3 if mode == "processes" else 1  # torchrun exits 1 whatever its worker's code
    assert res.returncode == code, res.stderr
    assert res.seconds < BOUND_S, res.stderr
    assert f"host node1 failed (exit code {code})" in res.stderr, res.stderr
    assert re.search(r"host=node0 node_rank=0 exit=[1-9]", res.stderr), res.stderr  # stopped
    assert_no_processes_left(launch.launch_id)


@pytest.mark.parametrize(("tool", "mode"), [("pdsh", "torchrun"), ("clush", "processes")])
def test_rank_killed_mid_run(tool: str, mode: str, tmp_path: Path, launches: list[Launch]) -> None:
    """SIGKILL one rank while the other waits for it in a collective."""
    launch = launch_args(tool, tmp_path, mode=mode)
    launches.append(launch)
    out = tmp_path / "out"
    proc = popen_hpc_ddp([*launch.base, "--", "python3", WORKER, "--out", str(out),
                          "--hang-rank", "1"])  # fmt: skip
    hanging = out / "hanging-1"
    wait_for(lambda: hanging.exists() and hanging.read_text(), 60, "rank 1 to start")
    killed_at = time.monotonic()
    os.kill(int(hanging.read_text()), signal.SIGKILL)
    _, stderr = proc.communicate(timeout=BOUND_S)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < BOUND_S
    # node0's rank may notice the dead peer (and fail) before node1's torchrun reports it:
    # node1 must be among the hosts named, not necessarily first.
    failed_line = next(line for line in stderr.splitlines() if "launch: FAILED on" in line)
    assert "node1 (exit" in failed_line, stderr
    assert_no_processes_left(launch.launch_id)


@pytest.mark.parametrize("tool", TOOLS)
def test_unreachable_host(tool: str, tmp_path: Path, launches: list[Launch]) -> None:
    """ssh cannot reach node1 (exit 255): node0, waiting for its peer, is stopped; node1 named."""
    launch = launch_args(tool, tmp_path, rcmd="ssh")
    launches.append(launch)
    out = tmp_path / "out"
    env = {
        "PATH": f"{fake_ssh_dir(tmp_path)}:{os.environ['PATH']}",
        "FAKE_SSH_UNREACHABLE": "node1",
    }
    res = hpc_ddp([*launch.base, "--", "python3", WORKER, "--out", str(out)], env=env)
    assert res.returncode != 0
    assert res.seconds < BOUND_S
    assert "Connection refused" in res.stderr and "FAILED on node1" in res.stderr, res.stderr
    assert "HINT: exit 255 is ssh's own: it could not connect or log in to node1" in res.stderr
    assert "ssh -oBatchMode=yes HOST true" in res.stderr, res.stderr
    # node0 did start, and was stopped (its host script reports the payload's non-zero exit).
    assert re.search(r"host=node0 node_rank=0 exit=[1-9]", res.stderr), res.stderr
    assert_no_processes_left(launch.launch_id)


@pytest.mark.parametrize("tool", TOOLS)
def test_ssh_to_this_machine_names_rcmd_exec(tool: str, tmp_path: Path) -> None:
    """What a first try on one machine looks like: `--hosts localhost` with the default
    `--rcmd ssh` and no sshd listening. The real ssh is refused (exit 255); the launch says that
    the code is ssh's and that `--rcmd exec` runs a launch here without ssh."""
    with socket.socket() as probe:
        probe.settimeout(2)
        if probe.connect_ex(("127.0.0.1", 22)) == 0:
            pytest.skip("an sshd listens on this machine: ssh to localhost may work here")
    res = hpc_ddp(
        ["launch", tool, "--hosts", "localhost", "--workdir", str(tmp_path), "--", "true"]
    )
    assert res.returncode == 255, res.stderr
    assert res.seconds < BOUND_S
    hint = next(line for line in res.stderr.splitlines() if "HINT:" in line)
    assert "exit 255 is ssh's own" in hint and "localhost is this machine" in hint, hint
    assert "pass --rcmd exec" in hint, hint


def _sleepers(launch_id: str) -> int:
    # procs.cmdline is empty for a process that exited after being listed (it may)
    return sum(1 for pid in processes_of(launch_id) if procs.cmdline(pid)[:1] == ["sleep"])


@pytest.mark.parametrize("tool", TOOLS)
def test_stop_command_ends_a_running_launch(
    tool: str, tmp_path: Path, launches: list[Launch]
) -> None:
    """torchrun puts its workers in sessions of their own: stop must end them too. The stop
    goes through the *other* tool: what it needs (tags, pid files) does not depend on the tool."""
    launch = launch_args(tool, tmp_path, mode="torchrun")
    launches.append(launch)
    proc = popen_hpc_ddp([*launch.base, "--", "sleep", "600"])
    wait_for(lambda: _sleepers(launch.launch_id) == 2, 60, "both hosts' workers to start")
    other = "clush" if tool == "pdsh" else "pdsh"
    if tool == "pdsh":  # the CLI's `launch stop`
        stop = hpc_ddp(launch.stop_args(via=other), timeout=BOUND_S)
        code, said = stop.returncode, stop.stdout + stop.stderr
    else:  # the same from Python
        out = io.StringIO()
        spec = api.make_launch_spec(
            tool=other, hosts="node[0-1]", command=["true"], rcmd="exec",
            launch_id=launch.launch_id, state_dir=str(launch.state_dir), stop_grace_s=3,
        )  # fmt: skip
        code, said = api.stop_launch(spec, out=out), out.getvalue()
    assert code == 0, said
    for host in ("node0", "node1"):
        assert f"{host}: hpc-ddp-launch-stop: {host}: stopped" in said, said
    _, stderr = proc.communicate(timeout=BOUND_S)
    assert proc.returncode != 0, stderr
    assert_no_processes_left(launch.launch_id)
    again = hpc_ddp(launch.stop_args(via=tool), timeout=BOUND_S)  # idempotent
    assert again.returncode == 0 and again.stdout.count("nothing running") == 2


def test_ctrl_c_on_the_launcher_stops_every_host(tmp_path: Path, launches: list[Launch]) -> None:
    launch = launch_args("pdsh", tmp_path)
    launches.append(launch)
    proc = popen_hpc_ddp([*launch.base, "--", "sleep", "600"])
    wait_for(lambda: _sleepers(launch.launch_id) == 2, 60, "both hosts' processes to start")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=BOUND_S)
    assert proc.returncode == 130, stderr
    assert "stopping the job on every host" in stderr
    assert_no_processes_left(launch.launch_id)


def test_wrong_node_order_is_refused(tmp_path: Path, launches: list[Launch]) -> None:
    """A tool numbering hosts differently from the canonical order must fail loudly: simulate it
    by giving pdsh the hosts reversed (pdsh keeps -w order)."""
    from hpc_ddp.deploy.shell.spec import make_spec
    from hpc_ddp.deploy.shell.tool_argv import launch_command

    spec = make_spec(tool="pdsh", hosts="node[0-1]", command=["true"], rcmd="exec",
                     launch_id="wrongorder", state_dir=str(tmp_path))  # fmt: skip
    argv = list(launch_command(spec).argv)
    argv[argv.index("node0,node1")] = "node1,node0"
    import subprocess

    res = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 97
    assert "host node1 got node rank 0" in res.stderr


@pytest.mark.parametrize("tool", TOOLS)
def test_timeout_bounds_every_host(tool: str, tmp_path: Path, launches: list[Launch]) -> None:
    """--timeout (pdsh/clush -u) is the last resort for a job that hangs on every host."""
    launch = launch_args(tool, tmp_path, extra=("--timeout", "3"))
    launches.append(launch)
    res = hpc_ddp([*launch.base, "--", "sleep", "600"], timeout=BOUND_S + 30)
    assert res.returncode == 124, res.stderr
    assert res.seconds < BOUND_S
    assert "command timeout" in res.stderr
    assert_no_processes_left(launch.launch_id)


def test_failing_setup_line_is_named(tmp_path: Path, launches: list[Launch]) -> None:
    launch = launch_args("pdsh", tmp_path, extra=("--setup", "module load no-such-module"))
    launches.append(launch)
    res = hpc_ddp([*launch.base, "--", "true"])
    assert res.returncode == 95, res.stderr
    assert "node1: setup step failed: module load no-such-module" in res.stderr
