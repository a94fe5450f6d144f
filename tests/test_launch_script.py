"""``hpc-ddp launch --render-script``: the standalone bash script runs, fails fast and stops.

As in the other launch tests, node0/node1 are pdsh's and clush's ``exec`` workers on this
machine (no second physical host exists here).
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from launch_support import (
    assert_no_processes_left,
    hpc_ddp,
    kill_leftovers,
    launch_args,
)

from hpc_ddp.localslurm import wait_for

# Node rank 1 fails at once; node rank 0 would sleep for 10 minutes unless stopped.
ONE_FAILS = ["bash", "-c", 'if [ "$HPC_DDP_NODE_RANK" = 1 ]; then exit 3; fi; exec sleep 600']


def _render(tool: str, tmp_path: Path, command: list[str]) -> tuple[Path, str]:
    launch = launch_args(tool, tmp_path)
    script = tmp_path / f"{tool}_launch.sh"
    res = hpc_ddp([*launch.base, "--render-script", str(script), "--", *command])
    assert res.returncode == 0, res.stderr
    return script, launch.launch_id


def _bash(script: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


@pytest.mark.parametrize("tool", ["pdsh", "clush"])
def test_rendered_script_runs_the_launch(tool: str, tmp_path: Path) -> None:
    script, launch_id = _render(tool, tmp_path, ["hpc-ddp", "env", "--json"])
    try:
        res = _bash(script)
        assert res.returncode == 0, res.stdout + res.stderr
        ranks = {}
        for line in res.stdout.splitlines():
            host, _, rest = line.partition(": ")
            if rest.startswith("{"):
                ranks[host] = json.loads(rest)["node_rank"]
        assert ranks == {"node0": 0, "node1": 1}
    finally:
        kill_leftovers(launch_id)


@pytest.mark.parametrize("tool", ["pdsh", "clush"])
def test_rendered_script_stops_every_host_when_one_fails(tool: str, tmp_path: Path) -> None:
    script, launch_id = _render(tool, tmp_path, ONE_FAILS)
    try:
        start = time.monotonic()
        res = _bash(script)
        assert res.returncode != 0
        assert time.monotonic() - start < 60
        assert "stopping every host" in res.stderr + res.stdout
        assert "node1" in res.stdout
        assert_no_processes_left(launch_id)
    finally:
        kill_leftovers(launch_id)


@contextlib.contextmanager
def _running(tool: str, tmp_path: Path) -> Iterator[tuple[Path, subprocess.Popen[str], str]]:
    """The rendered script running ``sleep 600`` on both hosts, once both recorded their process
    groups; afterwards it is killed and nothing it started is left."""
    script, launch_id = _render(tool, tmp_path, ["sleep", "600"])
    state = tmp_path / "state" / launch_id
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        wait_for(lambda: state.is_dir() and len(list(state.glob("*.pgid"))) == 2, 60,
                   "both hosts to record their process groups")  # fmt: skip
        yield script, proc, launch_id
    finally:
        proc.kill()
        kill_leftovers(launch_id)


def test_rendered_script_stop_action(tmp_path: Path) -> None:
    with _running("pdsh", tmp_path) as (script, proc, launch_id):
        stop = _bash(script, "stop", timeout=60)
        assert stop.returncode == 0, stop.stdout + stop.stderr
        assert stop.stdout.count(": stopped") == 2, stop.stdout
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0, out
        assert_no_processes_left(launch_id)


def test_rendered_script_ctrl_c_stops_every_host(tmp_path: Path) -> None:
    with _running("clush", tmp_path) as (_, proc, launch_id):
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130, out
        assert "interrupted; stopping every host" in out
        assert_no_processes_left(launch_id)
