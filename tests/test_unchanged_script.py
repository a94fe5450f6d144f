"""A script written for torchrun, which knows nothing of hpc-ddp, runs unchanged on every launch
path: each exports torch's env:// contract (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) derived from the launcher's own variables.

Real parts: the local Slurm cluster (2 nodes x 2 tasks; sbatch, srun, torchrun, submitit), pdsh's
exec worker, multi-process Gloo. Not real: a second physical host (the two slurmd and pdsh's two
"hosts" share this machine).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch_support import REPO, hpc_ddp, kill_leftovers, launch_args
from slurm_support import clean_job_env, require_tools

from hpc_ddp.slurm_client import wait_for

SCRIPT = str(REPO / "tests" / "workers" / "plain_ddp.py")


def _seen(out: Path, world: int) -> list[dict]:
    """What each rank saw, in rank order; every rank in one world of ``world`` that all-reduced."""
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert [r["rank"] for r in ranks] == list(range(world)), ranks
    assert {(r["world"], r["sum"]) for r in ranks} == {(world, world * (world + 1) // 2)}, ranks
    return ranks


def _per_node(ranks: list[dict], key: str) -> dict[str, list[int]]:
    nodes: dict[str, list[int]] = {}
    for r in ranks:
        nodes.setdefault(r[key], []).append(r["local_rank"])
    return nodes


def _render(cwd: Path, launcher: str) -> Path:
    job = cwd / "job.sbatch"
    (cwd / "out").mkdir()
    res = hpc_ddp(
        ["render", "--name", f"plain-{launcher}", "--nodes", "2", "--procs-per-node", "2",
         "--launcher", launcher, "--time", "5", "--python", sys.executable, "--script", SCRIPT,
         "--script-out", str(job), "--", str(cwd / "out")]
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return job


@pytest.mark.slurm
def test_rendered_srun_and_torchrun_jobs_export_torch_env(slurm_cluster, tmp_path: Path) -> None:
    """The default srun layout (one task per process: srun sets only SLURM_*) and the torchrun
    layout, side by side on the real cluster: 4 ranks on 2 nodes, local ranks 0 and 1 on each,
    MASTER_ADDR the first node. Before `hpc-ddp exec` in the srun step the script died with
    'environment variable RANK expected, but not set'."""
    jobs = {}
    for launcher in ("srun", "torchrun"):
        cwd = tmp_path / launcher
        cwd.mkdir()
        job_id, log = slurm_cluster.sbatch(_render(cwd, launcher), output=cwd / "job.out", cwd=cwd)
        jobs[launcher] = (cwd, job_id, log)
    for launcher, (cwd, job_id, log) in jobs.items():
        result = slurm_cluster.wait_job(job_id, 120, log)
        assert (result.state, result.exit_code) == ("COMPLETED", 0), log.read_text()
        ranks = _seen(cwd / "out", 4)
        assert _per_node(ranks, "slurm_node") == {"node1": [0, 1], "node2": [0, 1]}, ranks
        # srun: the first node; torchrun: its agents' rendezvous host, one for every rank.
        masters = {(r["master_addr"], r["local_world"]) for r in ranks}
        assert masters == {("node1", 2)} if launcher == "srun" else len(masters) == 1, masters


@pytest.mark.slurm
def test_submitit_executor_runs_the_script_with_torch_env(slurm_cluster, tmp_path: Path) -> None:
    """`hpc-ddp submit --executor submitit`, 2 nodes x 2 tasks: submitit starts the tasks with
    srun, and each task hands the script torch's variables."""
    out, folder = tmp_path / "out", tmp_path / "submitit"
    out.mkdir()
    spec = tmp_path / "job.toml"
    spec.write_text(
        f'name = "plain-submitit"\nnodes = 2\nprocs_per_node = 2\ntime = "5"\n'
        f"script = {json.dumps(SCRIPT)}\nargs = [{json.dumps(str(out))}]\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.cli", "submit", "--executor", "submitit", "--folder",
         str(folder), "--wait-timeout", "120", str(spec)],
        env=slurm_cluster.env, cwd=tmp_path, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = _seen(out, 4)
    assert _per_node(ranks, "slurm_node") == {"node1": [0, 1], "node2": [0, 1]}, ranks


def test_launch_pdsh_processes_mode_exports_torch_env(tmp_path: Path) -> None:
    """`hpc-ddp launch pdsh --mode processes` (the node agent starts each host's processes): two
    "hosts" x 2 processes, every one with its rank of 4."""
    require_tools("pdsh")
    out = tmp_path / "out"
    out.mkdir()
    launch = launch_args("pdsh", tmp_path, mode="processes", gpus_per_node=2)
    try:
        res = hpc_ddp([*launch.base, "--", sys.executable, SCRIPT, str(out)], timeout=120)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    finally:
        kill_leftovers(launch.launch_id)
    ranks = _seen(out, 4)
    assert sorted(r["local_rank"] for r in ranks) == [0, 0, 1, 1]
    assert {(r["master_addr"], r["local_world"]) for r in ranks} == {("127.0.0.1", 2)}


def test_exec_nproc_per_node_starts_a_local_world(tmp_path: Path) -> None:
    """`hpc-ddp exec --nproc-per-node 3 -- python script.py`: one machine's world, no torchrun."""
    out = tmp_path / "out"
    out.mkdir()
    res = hpc_ddp(["exec", "--nproc-per-node", "3", "--", sys.executable, SCRIPT, str(out)])
    assert res.returncode == 0, res.stderr
    ranks = _seen(out, 3)
    assert [(r["local_rank"], r["local_world"]) for r in ranks] == [(0, 3), (1, 3), (2, 3)]


def _exec_env(environ: dict[str, str]) -> tuple[int, dict[str, str], str]:
    """`hpc-ddp exec -- env` under ``environ`` (launcher variables as a launcher would set them
    on a host that cannot exist here); returns the code, the torch variables CMD saw, stderr."""
    env = {**clean_job_env(), **environ}
    proc = subprocess.run(
        [sys.executable, "-m", "hpc_ddp", "exec", "--", "env"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    seen = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    return proc.returncode, {k: seen[k] for k in keys if k in seen}, proc.stderr


SLURM_PER_NODE = {  # task 1 of a per-node step: 2 nodes x 1 task driving 4 GPUs
    "SLURM_JOB_ID": "41", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
    "HPC_DDP_GPUS_PER_PROCESS": "4", "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}  # fmt: skip


def test_exec_per_node_layout_ranks_are_nodes() -> None:
    """The per-node layout: one process per node drives all its GPUs, so RANK is the node's."""
    code, seen, err = _exec_env(SLURM_PER_NODE)
    assert code == 0, err
    assert seen == {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "gpu07", "MASTER_PORT": seen["MASTER_PORT"]}  # fmt: skip
    assert 20000 <= int(seen["MASTER_PORT"]) < 32768  # derived from the job id


def test_exec_refuses_a_contradiction_naming_both() -> None:
    code, seen, err = _exec_env({**SLURM_PER_NODE, "RANK": "5"})
    assert code == 2 and not seen, err
    assert "RANK" in err and "SLURM_PROCID" in err and "Traceback" not in err, err


def test_exec_names_a_missing_command() -> None:
    res = hpc_ddp(["exec", "--", "no-such-program-here"])
    assert res.returncode == 127 and "cannot run 'no-such-program-here'" in res.stderr
    res = hpc_ddp(["exec"])
    assert res.returncode == 2 and "hpc-ddp exec -- python train.py" in res.stderr


def test_exec_keeps_the_pid_srun_signals(tmp_path: Path) -> None:
    """exec replaces itself with CMD: the pid srun started is CMD's, so its signals (preemption
    warnings) reach the program, not a wrapper that would die of them."""
    probe = subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp", "exec", "--", sys.executable, "-c",
         "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()"],
        env=clean_job_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert int(probe.stdout.readline()) == probe.pid
    finally:
        probe.communicate("", timeout=30)
    wait_for(lambda: probe.poll() is not None, 10, "the probe to end")
