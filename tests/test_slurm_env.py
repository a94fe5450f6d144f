"""The foundation, proven on a real Slurm cluster: what each srun task is told, and a real
Gloo group built from it. The local cluster's nodes share this machine's network, so
MASTER_ADDR = node1 resolves to loopback (docs/local-cluster.md)."""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_support import HPC_DDP, SlurmTestCluster, require_local_slurm

from hpc_ddp.deploy.sbatch.render import preflight_command
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.localslurm import LocalCluster

pytestmark = pytest.mark.slurm

WORKER = str(Path(__file__).parent / "workers" / "slurm_allreduce.py")
PROBE = str(Path(__file__).parent / "workers" / "env_probe.py")
DIST_WORKER = str(Path(__file__).parent / "workers" / "dist_worker.py")


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


def test_batch_script_of_slurm_26_sees_its_step_id_and_still_forgot_srun(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    """Slurm 26.05 sets SLURM_STEP_ID in the batch script too: the batch step's id 0xfffffffb
    printed signed, "-5" (src/common/env.c). Slurm 22.05 here sets none, so the script exports
    what 26.05 would; everything else is the real batch shell of a 2-node job."""
    script = tmp_path / "forgot26.sh"
    script.write_text(
        f"#!/bin/bash\nexport SLURM_STEP_ID=-5 SLURM_STEPID=-5\n{slurm_cluster.hpc_ddp} env\n"
    )
    res = slurm_cluster.sbatch_wait(script, "-N2", timeout_s=60, output=tmp_path / "out")
    assert (res.state, res.exit_code) == ("FAILED", 2), res.output
    assert "srun forgotten" in res.output and "Slurm's batch step" in res.output, res.output


# ---- steps whose node list is not in task order ---------------------------------------------


def test_heterogeneous_step_master_is_component_0s_first_node(
    slurm_cluster: SlurmTestCluster,
) -> None:
    """srun allocates a heterogeneous job, component 0 on node2 and component 1 (2 tasks) on
    node1, and sorts the step's node list to node[1-2], tasks per node 2,1, while SLURM_NODEID
    counts node2 first. Task 0 runs on node2; before, every task named node1."""
    env = [slurm_cluster.hpc_ddp, "env", "--json"]
    tasks = _srun_json(slurm_cluster, ["-w", "node2", "-n1", *env, ":", "-w", "node1", "-n2"], env)
    assert [t["rank"] for t in tasks] == [0, 1, 2]
    assert {(t["master_addr"], t["world_size"], t["num_nodes"]) for t in tasks} == {("node2", 3, 2)}
    assert [(t["node_rank"], t["local_rank"], t["local_world_size"]) for t in tasks] == [
        (0, 0, 1),
        (1, 0, 2),
        (1, 1, 2),
    ]


def test_heterogeneous_step_in_an_ordinary_job_fails_loudly(
    slurm_cluster: SlurmTestCluster,
) -> None:
    """`srun A : B` inside a plain allocation: the node list is sorted just the same but no
    variable gives the components' order. Each task sees that SLURMD_NODENAME is not the node
    SLURM_NODEID names; before, task 0 trained against node1 as its master."""
    env = [slurm_cluster.hpc_ddp, "env", "--json"]
    step = ["srun", "-N1", "-w", "node2", "-n1", *env, ":", "-N1", "-w", "node1", "-n2", *env]
    proc = slurm_cluster.run(["salloc", "-N2", "-n4", *step], timeout_s=90, check=False)
    assert proc.returncode != 0 and not _json_lines(proc.stdout), proc.stdout
    assert proc.stderr.count("this task runs on SLURMD_NODENAME=") == 3, proc.stderr
    assert "HINT:" in proc.stderr and "hetjob" in proc.stderr


def test_arbitrary_distribution_master_is_the_hostfiles_first_host(
    slurm_cluster: SlurmTestCluster, tmp_path: Path
) -> None:
    """srun -m arbitrary runs task i on the hostfile's line i: task 0 on node2, while the node
    list says node[1-2]. Given the hosts with -w instead, the tasks cannot know where rank 0
    runs and say so."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node2\nnode1\nnode1\n")
    env = [slurm_cluster.hpc_ddp, "env", "--json"]
    argv = ["env", f"SLURM_HOSTFILE={hostfile}", "srun", "-m", "arbitrary", "-n3", *env]
    proc = slurm_cluster.run(argv, timeout_s=60, check=False)
    assert proc.returncode == 0, proc.stderr
    tasks = sorted(_json_lines(proc.stdout), key=lambda t: t["rank"])
    assert [t["rank"] for t in tasks] == [0, 1, 2]
    assert {t["master_addr"] for t in tasks} == {"node2"}
    assert [t["node_rank"] for t in tasks] == [1, 0, 0]
    listed = slurm_cluster.srun(["-m", "arbitrary", "-w", "node2,node1,node1", "-n3", *env])
    assert listed.returncode != 0 and not _json_lines(listed.stdout), listed.stdout
    assert listed.stderr.count("SLURM_HOSTFILE is not set in this task") == 3, listed.stderr


# ---- a cluster that reserves ports per step ------------------------------------------------


def _free_port_block(count: int, lo: int = 30000, hi: int = 32000) -> range:
    """``count`` consecutive ports free right now, below the ephemeral range (32768+)."""
    for start in range(lo, hi - count, count):
        block = range(start, start + count)
        with contextlib.ExitStack() as stack:
            try:
                for port in block:
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("0.0.0.0", port))
            except OSError:
                continue
            return block
    raise AssertionError(f"no {count} consecutive free ports in [{lo}, {hi})")


@pytest.fixture(scope="module")
def resv_cluster() -> Iterator[tuple[SlurmTestCluster, range]]:
    """2 nodes whose slurm.conf reserves ports per step (MpiParams=ports=A-B) and puts
    salloc's shell in Slurm's interactive step (use_interactive_step), which runs
    `hpc-ddp env --json` in place of a shell."""
    require_local_slurm()
    ports = _free_port_block(10)
    root = Path(tempfile.mkdtemp(prefix="hpcddp-resv-", dir="/tmp"))
    step = f"--interactive --preserve-env --mpi=none {HPC_DDP} env --json"
    extra = {
        "MpiParams": f"ports={ports[0]}-{ports[-1]}",
        "LaunchParameters": "use_interactive_step",
        "InteractiveStepOptions": f'"{step}"',
    }
    cluster = LocalCluster(root, ephemeral=True, nodes=2, cpus_per_node=4, extra=extra)
    cluster.start(timeout_s=30)
    try:
        yield SlurmTestCluster(cluster), ports
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def _resv_first(task: dict) -> int:
    origin = task["master_port_origin"]
    assert origin.startswith("SLURM_STEP_RESV_PORTS="), origin
    return int(origin.split("=", 1)[1].split(",")[0].split("-")[0])


def test_srun_tasks_take_master_port_from_the_steps_reserved_ports(resv_cluster) -> None:
    cluster, ports = resv_cluster
    tasks = _srun_env(cluster, "-N2", "-n4")
    _check_common(tasks, world=4, nodes=2, master="node1")
    for task in tasks:
        assert task["master_port"] == _resv_first(task) and task["master_port"] in ports


def test_two_steps_sharing_a_node_get_different_ports(resv_cluster) -> None:
    """Step A holds its ports (it waits on stdin) while step B starts on the same node."""
    cluster, ports = resv_cluster
    command = f"{HPC_DDP} env --json; read line"
    argv = ["srun", "-w", "node1", "-N1", "-n1", "bash", "-c", command]
    first = subprocess.Popen(
        argv, env=cluster.env, cwd=cluster.workdir, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert first.stdout is not None
        line_a = first.stdout.readline()  # returns once A runs (or ends: then it is empty)
        assert line_a.startswith("{"), line_a + (first.stderr.read() if first.stderr else "")
        [b] = _srun_env(cluster, "-w", "node1", "-N1", "-n1")
    finally:
        _, err = first.communicate(input="\n", timeout=60)
    a = json.loads(line_a)
    assert first.returncode == 0, err
    assert a["master_port"] != b["master_port"], (a, b)
    assert {a["master_port"], b["master_port"]} <= set(ports)


def test_gloo_allreduce_over_a_reserved_port(resv_cluster) -> None:
    cluster, ports = resv_cluster
    proc = cluster.srun(["-N2", "-n2", cluster.python, WORKER], timeout_s=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = sorted(_json_lines(proc.stdout), key=lambda r: r["rank"])
    assert {r["sum"] for r in records} == {3.0} and len(records) == 2
    assert len({r["master_port"] for r in records}) == 1 and records[0]["master_port"] in ports


def test_rank_0_names_the_reserved_port_a_stray_process_holds(resv_cluster) -> None:
    """Real listeners on every port of the range, then a real one-task Gloo init under srun:
    rank 0 fails in seconds (not at its 60 s connect deadline) naming port, source and fix."""
    cluster, ports = resv_cluster
    with contextlib.ExitStack() as stack:
        for port in ports:  # SO_REUSEADDR: an earlier test's port may still be in TIME_WAIT
            stack.enter_context(socket.create_server(("0.0.0.0", port)))
        started = time.monotonic()
        argv = ["-N1", "-n1", cluster.python, DIST_WORKER, "--connect-timeout-s", "60"]
        proc = cluster.srun(argv, timeout_s=90)
        took = time.monotonic() - started
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 0 could not listen on port" in out, out
    assert "(port source: SLURM_STEP_RESV_PORTS=" in out, out
    assert "HINT: Slurm reserved" in out and "export MASTER_PORT=<a free port>" in out, out
    assert took < 45, f"{took:.1f} s"


def test_salloc_interactive_step_is_srun_forgotten(resv_cluster) -> None:
    """Slurm's interactive step (SLURM_STEP_ID=4294967290) is one task of its own inside a job
    of 4: read as a task it was rank 0 of 1, training alone."""
    cluster, _ = resv_cluster
    proc = subprocess.run(
        ["salloc", "-N2", "-n4"], env=cluster.env, cwd=cluster.workdir, text=True,
        stdin=subprocess.DEVNULL, capture_output=True, timeout=90,
    )  # fmt: skip
    assert "srun forgotten" in proc.stderr and "Slurm's interactive step" in proc.stderr, (
        proc.stdout + proc.stderr
    )
    assert "HINT:" in proc.stderr and not _json_lines(proc.stdout)


def test_a_spec_with_resv_ports_renders_srun_lines_that_get_them(
    resv_cluster, slurm_cluster: SlurmTestCluster
) -> None:
    """The rendered preflight step (same srun options as training) run for real: every task
    reports a reserved port; where the cluster has none, srun refuses the step."""
    cluster, ports = resv_cluster
    spec = JobSpec(nodes=2, procs_per_node=2, resv_ports=True, python=sys.executable)
    command = preflight_command(spec)
    assert "--resv-ports=1" in shlex.split(command)
    proc = subprocess.run(
        ["bash", "-c", command], env=cluster.env, cwd=cluster.workdir, text=True,
        capture_output=True, timeout=90,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    masters = {w for line in proc.stdout.splitlines() for w in line.split() if "master=" in w}
    assert len(masters) == 1 and int(masters.pop().rsplit(":", 1)[1]) in ports, proc.stdout
    plain = subprocess.run(
        ["bash", "-c", command], env=slurm_cluster.env, cwd=slurm_cluster.workdir, text=True,
        capture_output=True, timeout=90,
    )  # fmt: skip
    assert plain.returncode != 0 and "port" in plain.stderr.lower(), plain.stderr


def test_doctor_says_the_cluster_reserves_ports(resv_cluster, tmp_path: Path) -> None:
    """On the login node it reads slurmctld's config; in a step it shows the step's ports."""
    cluster, ports = resv_cluster
    login = cluster.run([HPC_DDP, "doctor", "--no-torch", "--run-dir", str(tmp_path)], 60, False)
    line = next(x for x in login.stdout.splitlines() if "reserved ports:" in x)
    assert line.startswith("OK") and f"reserves ports {ports[0]}-{ports[-1]} per step" in line
    argv = ["-N1", "-n1", HPC_DDP, "doctor", "--no-torch", "--run-dir", str(tmp_path)]
    step = cluster.srun(argv, timeout_s=60)
    lines = step.stdout.splitlines()
    line = next(x for x in lines if "reserved ports:" in x)
    assert "this step has SLURM_STEP_RESV_PORTS=" in line, step.stdout
    port_line = next(x for x in lines if "master port:" in x)
    assert port_line.startswith("OK") and "(SLURM_STEP_RESV_PORTS=" in port_line, port_line
