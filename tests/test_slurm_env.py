"""The foundation, proven on a real Slurm cluster: what each srun task is told, and a real
Gloo group built from it. The local cluster's nodes share this machine's network, so
MASTER_ADDR = node1 resolves to loopback (docs/local-cluster.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from slurm_support import SlurmTestCluster

pytestmark = pytest.mark.slurm

WORKER = str(Path(__file__).parent / "workers" / "slurm_allreduce.py")
PROBE = str(Path(__file__).parent / "workers" / "env_probe.py")


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _srun_json(cluster: SlurmTestCluster, srun_args: list[str], command: list[str]) -> list:
    """Run ``command`` under ``srun``; every task prints one JSON line. Sorted by rank."""
    proc = cluster.srun([*srun_args, *command], timeout_s=60)
    assert proc.returncode == 0, proc.stderr
    tasks = sorted(_json_lines(proc.stdout), key=lambda t: t["rank"])
    assert tasks, proc.stdout
    return tasks


def _srun_env(cluster: SlurmTestCluster, *srun_args: str, env_args: tuple[str, ...] = ()) -> list:
    """`srun ... hpc-ddp env --json`: the absolute path, so the task runs this project."""
    return _srun_json(cluster, list(srun_args), [cluster.hpc_ddp, "env", "--json", *env_args])


def _srun_probe(cluster: SlurmTestCluster, *srun_args: str, gpus_per_process: int = 1) -> list:
    """detect_env() in each task, GPUs counted from CUDA_VISIBLE_DEVICES (see env_probe.py)."""
    command = [cluster.python, PROBE, str(gpus_per_process)]
    return _srun_json(cluster, list(srun_args), command)


def _check_common(tasks: list[dict], world: int, nodes: int, master: str) -> None:
    """What every layout must satisfy: one world, one rendezvous point, consistent ranks."""
    assert [t["rank"] for t in tasks] == list(range(world))
    for key, want in {
        "source": "slurm",
        "world_size": world,
        "num_nodes": nodes,
        "master_addr": master,
    }.items():
        assert {t[key] for t in tasks} == {want}, key
    assert len({t["master_port"] for t in tasks}) == 1
    assert len({t["job_id"] for t in tasks}) == 1 and tasks[0]["job_id"]
    # Ranks are laid out node by node (block distribution), local ranks count up from 0.
    by_node: dict[int, list[dict]] = {}
    for t in tasks:
        by_node.setdefault(t["node_rank"], []).append(t)
    assert sorted(by_node) == list(range(nodes))
    for node_tasks in by_node.values():
        assert [t["local_rank"] for t in node_tasks] == list(range(len(node_tasks)))
        assert {t["local_world_size"] for t in node_tasks} == {len(node_tasks)}


def test_srun_two_nodes_four_tasks(slurm_cluster: SlurmTestCluster) -> None:
    tasks = _srun_env(slurm_cluster, "-N2", "-n4")
    _check_common(tasks, world=4, nodes=2, master="node1")
    assert {t["gpus"] == [] and t["devices"] == ["cpu"] for t in tasks} == {True}


def test_srun_heterogeneous_three_tasks_on_two_nodes(slurm_cluster: SlurmTestCluster) -> None:
    """3 tasks on 2 nodes: Slurm puts 2 on node1 and 1 on node2 (SLURM_STEP_TASKS_PER_NODE=2,1)."""
    tasks = _srun_env(slurm_cluster, "-N2", "-n3")
    _check_common(tasks, world=3, nodes=2, master="node1")
    assert [(t["node_rank"], t["local_rank"], t["local_world_size"]) for t in tasks] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 1),
    ]


def test_srun_one_gpu_per_task_on_fake_gpus(slurm_gpu_cluster: SlurmTestCluster) -> None:
    """Fake GPUs (gres on char devices; no CUDA here): Slurm gives each task its own GPU through
    CUDA_VISIBLE_DEVICES, so each task must use its device 0. `hpc-ddp env` reports CPU without
    an NVIDIA driver, so the device choice is read through detect_env (env_probe.py)."""
    shape = ("-N2", "-n4", "--gpus-per-task=1")
    tasks = _srun_probe(slurm_gpu_cluster, *shape)
    _check_common(tasks, world=4, nodes=2, master="node1")
    assert [t["gpus"] for t in tasks] == [[0]] * 4
    for node in (0, 1):
        seen = sorted(t["cuda_visible_devices"] for t in tasks if t["node_rank"] == node)
        assert seen == ["0", "1"]  # two tasks of one node never share a GPU
    # The command itself agrees on everything else and shows what Slurm exported.
    cli = _srun_env(slurm_gpu_cluster, *shape)
    _check_common(cli, world=4, nodes=2, master="node1")
    assert sorted(t["cuda_visible_devices"] for t in cli) == ["0", "0", "1", "1"]


def test_one_process_per_node_drives_all_its_gpus(slurm_gpu_cluster: SlurmTestCluster) -> None:
    shape = ("-N2", "--ntasks-per-node=1", "--gpus-per-node=2")
    tasks = _srun_probe(slurm_gpu_cluster, *shape, gpus_per_process=2)
    _check_common(tasks, world=2, nodes=2, master="node1")
    assert [(t["rank"], t["node_rank"], t["local_rank"]) for t in tasks] == [(0, 0, 0), (1, 1, 0)]
    assert [t["gpus"] for t in tasks] == [[0, 1], [0, 1]]
    assert [t["cuda_visible_devices"] for t in tasks] == ["0,1", "0,1"]
    cli = _srun_env(slurm_gpu_cluster, *shape, env_args=("--gpus-per-process", "2"))
    _check_common(cli, world=2, nodes=2, master="node1")
    assert {t["gpus_per_process"] for t in cli} == {2}


def test_batch_script_that_forgets_srun_fails_with_a_hint(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    script = tmp_path / "forgot.sh"
    script.write_text(f"#!/bin/bash\n{slurm_cluster.hpc_ddp} env\n")
    res = slurm_cluster.sbatch_wait(script, "-N2", timeout_s=60, output=tmp_path / "out")
    assert (res.state, res.exit_code) == ("FAILED", 2), res.output
    assert "srun forgotten" in res.output
    hint = [line for line in res.output.splitlines() if line.startswith("HINT:")]
    assert hint and "srun" in hint[0], res.output


def test_gloo_allreduce_across_two_nodes(slurm_cluster: SlurmTestCluster) -> None:
    proc = slurm_cluster.srun(["-N2", "-n2", slurm_cluster.python, WORKER], timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = sorted(_json_lines(proc.stdout), key=lambda r: r["rank"])
    assert [r["rank"] for r in records] == [0, 1]
    assert [r["node_rank"] for r in records] == [0, 1]
    assert {r["sum"] for r in records} == {3.0}
    assert {r["backend"] for r in records} == {"gloo"}
    assert {r["master_addr"] for r in records} == {"node1"}


def test_a_failed_rank_ends_the_step_instead_of_hanging(slurm_cluster: SlurmTestCluster) -> None:
    """Rank 1 exits 3 after joining; rank 0 waits in an all-reduce that can never finish.
    --kill-on-bad-exit makes Slurm end the step: non-zero, bounded time, no hang."""
    argv = ["--kill-on-bad-exit=1", "-N2", "-n2", slurm_cluster.python, WORKER, "--exit-rank=1"]
    started = time.monotonic()
    proc = slurm_cluster.srun(argv, timeout_s=90)
    took = time.monotonic() - started
    assert proc.returncode != 0
    assert {"rank": 1, "exiting": 3} in _json_lines(proc.stdout)
    assert "exited with exit code 3" in proc.stderr.lower(), proc.stderr
    assert took < 60, f"the step took {took:.1f} s to end"
