"""`hpc-ddp env`: real subprocesses of the installed command, and a real torchrun launch."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_cluster_env import ARBITRARY, HET_GROUPS, HET_STEP

ENVS = Path(__file__).parent / "data" / "envs"
BIN = Path(sys.executable).parent
HPC_DDP = str(BIN / "hpc-ddp")
KEYS = {
    "source", "rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes",
    "master_addr", "master_port", "backend", "backend_reason", "interconnect", "devices",
    "job_id", "layout", "hostname",
}  # fmt: skip
# Launcher variables of the machine running the tests must not leak into these runs.
LAUNCH_PREFIXES = (
    "SLURM_", "SLURMD_", "TORCHELASTIC_", "OMPI_", "PMI", "MV2_", "SUBMITIT_", "HPC_DDP_",
)  # fmt: skip
LAUNCH_NAMES = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES",
}  # fmt: skip


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(LAUNCH_PREFIXES) and k not in LAUNCH_NAMES
    }
    env.update(extra)
    return env


def hpc_ddp_env(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HPC_DDP, "env", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_json_single_process() -> None:
    out = hpc_ddp_env("--json", env=clean_env())
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data.keys() >= KEYS
    assert (data["source"], data["rank"], data["world_size"]) == ("single", 0, 1)
    assert data["backend"] in ("gloo", "nccl") and data["backend_reason"]


def test_human_table() -> None:
    out = hpc_ddp_env(env=clean_env())
    assert out.returncode == 0, out.stderr
    rows = dict(line.split(None, 1) for line in out.stdout.splitlines() if " " in line)
    assert rows["launcher"].strip() == "single"
    assert "backend" in rows and "why" in rows


def test_never_imports_torch_and_is_fast() -> None:
    """The command must answer in well under a second: torch alone costs 1.5-2 s to import.

    CPU time, not wall time, is bounded: other test suites share the 2 cores.
    """
    code = (
        "import sys, time; t = time.process_time(); from hpc_ddp.cli import main; "
        "rc = main(['env', '--json']); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', time.process_time() - t, rc)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    marker, seconds, rc = out.stdout.splitlines()[-1].split()
    assert (marker, rc) == ("NO-TORCH", "0"), out.stderr
    assert float(seconds) < 0.3
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert hpc_ddp_env("--json", env=clean_env()).returncode == 0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert cpu < 0.6  # interpreter start included; importing torch alone would exceed it


def _tasks(*tasks: tuple[int, int, int, str]) -> list[dict[str, str]]:
    """SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID and SLURMD_NODENAME of each task."""
    keys = ("SLURM_PROCID", "SLURM_NODEID", "SLURM_LOCALID", "SLURMD_NODENAME")
    return [dict(zip(keys, map(str, task), strict=True)) for task in tasks]


HET_TASKS = _tasks((0, 0, 0, "gpu01"), (1, 0, 1, "gpu01"), (2, 1, 0, "cpu01"), (3, 2, 0, "cpu02"))
ARBITRARY_TASKS = _tasks((0, 1, 0, "node2"), (1, 0, 0, "node1"), (2, 0, 1, "node1"))

# A torchrun worker's variables (rank 0 of 2 on one node), to break in the table below.
TORCHRUN_VARS = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
TORCHRUN_VARS |= {"LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"SLURM_JOB_ID": "12", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, "srun forgotten"),
        ({"MASTER_PORT": "99999"}, "not a TCP port"),
        ({"RANK": "1", "WORLD_SIZE": "2"}, "no launcher"),
        ({"HPC_DDP_GPUS_PER_PROCESS": "x"}, "not an integer"),
        # Other scripts' digits: '\u00b3' ended in a traceback, '\u0662' was read as 2.
        ({"SLURM_JOB_ID": "\u00b3", "SLURM_NTASKS": "1"}, "SLURM_JOB_ID='\u00b3' is not"),
        ({"MASTER_PORT": "\u0662\u0669\u0665\u0660\u0660"}, "not a TCP port"),
        ({"HPC_DDP_GPUS_PER_PROCESS": "\u0662"}, "not an integer"),
        # A launcher's empty MASTER_ADDR was taken as the address ''.
        ({**TORCHRUN_VARS, "MASTER_ADDR": ""}, "MASTER_ADDR='' is empty"),
        ({**TORCHRUN_VARS, "LOCAL_WORLD_SIZE": "4"}, "local world size 4 is larger than the"),
        # Slurm 26.05's batch script: SLURM_STEP_ID=-5 is the batch step, not task 0.
        (
            {
                "SLURM_JOB_ID": "12",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": "0",
                "SLURM_STEP_ID": "-5",
                "SLURM_STEPID": "-5",
            },
            "srun forgotten",
        ),
        # DeepSpeed's launcher (or the legacy torch.distributed.launch) in `salloc -N1`: every
        # worker was rank 0 of a world of 1.
        (
            {
                "SLURM_JOB_ID": "777",
                "SLURM_NTASKS": "1",
                "SLURM_JOB_NUM_NODES": "1",
                "RANK": "3",
                "WORLD_SIZE": "8",
                "LOCAL_RANK": "3",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500",
            },
            "RANK=3 WORLD_SIZE=8 are set in Slurm job 777",
        ),
        # A heterogeneous step without its components' node lists: task 0 took cpu01 (sorted
        # first) as MASTER_ADDR and 1 process on its node.
        ({**HET_STEP, **HET_TASKS[0]}, "without SLURM_JOB_NODELIST_HET_GROUP_0"),
        # srun -m arbitrary -w ...: rank 0's host is not in any variable.
        ({**ARBITRARY, **ARBITRARY_TASKS[0]}, "SLURM_HOSTFILE is not set in this task"),
    ],
)
def test_errors_exit_2_with_hint(extra: dict[str, str], message: str) -> None:
    out = hpc_ddp_env("--json", env=clean_env(**extra))
    assert out.returncode == 2, out.stderr
    assert message in out.stderr and "HINT: " in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""


def _every_task(base: dict[str, str], tasks: list[dict[str, str]]) -> list[dict]:
    outs = [hpc_ddp_env("--json", env=clean_env(**base, **task)) for task in tasks]
    assert [out.returncode for out in outs] == [0] * len(tasks), [out.stderr for out in outs]
    return [json.loads(out.stdout) for out in outs]


def test_het_step_tasks_agree_on_component_0s_first_node() -> None:
    """Before, every task named cpu01 (first of the sorted list) and the wrong node sizes."""
    ranks = _every_task({**HET_STEP, **HET_GROUPS}, HET_TASKS)
    assert {r["master_addr"] for r in ranks} == {"gpu01"}
    assert [(r["rank"], r["node_rank"], r["local_world_size"]) for r in ranks] == [
        (0, 0, 2),
        (1, 0, 2),
        (2, 1, 1),
        (3, 2, 1),
    ]


def test_arbitrary_tasks_take_master_from_the_hostfile(tmp_path: Path) -> None:
    """Before, every task named node1 (first of the node list); task 0 runs on node2."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node2\nnode1\nnode1\n")
    ranks = _every_task({**ARBITRARY, "SLURM_HOSTFILE": str(hostfile)}, ARBITRARY_TASKS)
    assert {r["master_addr"] for r in ranks} == {"node2"}
    assert [r["rank"] for r in ranks] == [0, 1, 2]


def test_an_enormous_host_list_is_refused_in_well_under_a_second() -> None:
    """10**15 host names in the step's node list: counted from the ranges, never expanded (it
    ran out of time or memory before). CPU time is bounded; other suites share the cores."""
    proc = json.loads((ENVS / "slurm_srun_2x2.json").read_text())["processes"][3]
    environ = clean_env(
        **{**proc["environ"], "SLURM_STEP_NODELIST": "n[0-99999][0-99999][0-99999]"}
    )
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = hpc_ddp_env("--json", env=environ)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 2 and "more than 65536 hosts" in out.stderr, out.stderr
    assert cpu < 0.6  # the whole command, interpreter start included


def test_captured_slurm_task_through_the_command() -> None:
    """A real srun task's variables (captured) given to the real command."""
    proc = json.loads((ENVS / "slurm_srun_hetero_2x3_1.json").read_text())["processes"][5]
    out = hpc_ddp_env("--json", env=clean_env(**proc["environ"]))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key, value in proc["expected"].items():
        assert data[key] == value, key
    assert "7 processes on 4 nodes" in data["layout"]


def test_gpus_per_process_flag() -> None:
    proc = json.loads((ENVS / "slurm_srun_one_process_per_node_2gpus.json").read_text())
    environ = clean_env(**proc["processes"][0]["environ"])
    assert hpc_ddp_env("--json", env=environ).returncode == 2  # 1 task, 2 GPUs, gpp 1
    out = hpc_ddp_env("--json", "--gpus-per-process", "2", env=environ)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["gpus_per_process"] == 2


@pytest.mark.timeout(120)
def test_real_torchrun_two_ranks() -> None:
    torchrun = BIN / "torchrun"
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not installed")
    env = clean_env(PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    out = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node=2",
            "--no-python",
            HPC_DDP,
            "env",
            "--json",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr
    ranks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["source"] == "torchrun"
        assert (r["world_size"], r["local_world_size"], r["num_nodes"]) == (2, 2, 1)
        assert r["local_rank"] == r["rank"] and r["node_rank"] == 0
    assert ranks[0]["master_port"] == ranks[1]["master_port"]
    assert ranks[0]["job_id"] == ranks[1]["job_id"] is not None
