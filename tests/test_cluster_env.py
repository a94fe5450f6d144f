"""detect_env over real captured environments, every error it must raise, and GPU assignment.

Captures in tests/data/envs/ come from real launchers on this machine (Slurm minicluster,
torchrun, submitit LocalExecutor); the MPI and pdsh ones are written by hand (no MPI here; the
pdsh launcher is another module's) and say so in their "captured" field. There is no GPU here:
GPU hosts are faked with a /proc/driver/nvidia/gpus tree under tmp_path, and Slurm's GPU
captures used its fake-GPU GRES (character devices), which set the real CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.cluster import PRECEDENCE, DistEnv, detect_env, detect_source
from hpc_ddp.cluster.devices import assign_gpus, count_visible_gpus, parse_visible_devices
from hpc_ddp.cluster.master_port import PORT_BASE, PORT_SPAN, derive_port
from hpc_ddp.errors import LaunchEnvError

ENVS = Path(__file__).parent / "data" / "envs"
CAPTURES = sorted(ENVS.glob("*.json"))


def _cases() -> list[tuple[str, int, dict]]:
    cases = []
    for path in CAPTURES:
        for index, proc in enumerate(json.loads(path.read_text())["processes"]):
            cases.append((path.stem, index, proc))
    return cases


@pytest.fixture
def no_gpu_proc(tmp_path: Path) -> str:
    """A /proc without an NVIDIA driver, so the real host's state cannot leak in."""
    return str(tmp_path / "proc")


def fake_gpu_proc(root: Path, count: int) -> str:
    """Fake GPU host: /proc/driver/nvidia/gpus/<pci id> per GPU (no real GPU exists here)."""
    for i in range(count):
        (root / "driver" / "nvidia" / "gpus" / f"0000:{i:02x}:00.0").mkdir(parents=True)
    return str(root)


def test_captures_exist() -> None:
    names = {p.stem for p in CAPTURES}
    assert {
        "slurm_srun_2x2",
        "torchrun_standalone",
        "submitit_local",
        "slurm_srun_torchrun",
        "slurm_interactive_step",
        "slurm_srun_resv_ports",
        "slurm_het_job_step",
        "slurm_srun_het_allocation",
        "slurm_het_step_in_plain_job",
        "slurm_srun_arbitrary_w",
    } <= names


@pytest.mark.parametrize(("capture", "index", "proc"), _cases(), ids=lambda v: str(v)[:40])
def test_captured_environment(capture: str, index: int, proc: dict, no_gpu_proc: str) -> None:
    kwargs = {"gpus_per_process": proc.get("gpus_per_process"), "proc_root": no_gpu_proc}
    if "expected_error" in proc:
        with pytest.raises(LaunchEnvError, match=proc["expected_error"]) as err:
            detect_env(proc["environ"], **kwargs)
        assert err.value.hint
        return
    env = detect_env(proc["environ"], **kwargs)
    assert {k: v for k, v in env.to_json().items() if k != "layout"} == proc["expected"]


def test_captures_agree_within_a_job(no_gpu_proc: str) -> None:
    """All processes of one launch see one world, one master and distinct ranks 0..N-1."""
    for path in CAPTURES:
        procs = [p for p in json.loads(path.read_text())["processes"] if "expected" in p]
        if len(procs) < 2:
            continue
        envs = [
            detect_env(
                p["environ"], gpus_per_process=p.get("gpus_per_process"), proc_root=no_gpu_proc
            )
            for p in procs
        ]
        assert sorted(e.rank for e in envs) == list(range(envs[0].world_size)), path.stem
        assert len({(e.master_addr, e.master_port, e.world_size) for e in envs}) == 1, path.stem


# A real srun task (slurm_srun_2x2, rank 3) to break in the error table.
SRUN = json.loads((ENVS / "slurm_srun_2x2.json").read_text())["processes"][3]["environ"]
TORCHRUN = json.loads((ENVS / "torchrun_standalone.json").read_text())["processes"][1]["environ"]
STARTED = json.loads((ENVS / "hpc_ddp_pdsh_2x2.json").read_text())["processes"][3]["environ"]
OMPI = json.loads((ENVS / "openmpi_mpirun_2x2.json").read_text())["processes"][3]["environ"]


def _with(base: dict, **changes: str | None) -> dict:
    env = dict(base)
    for key, value in changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


ERRORS = [
    (
        "srun forgotten",
        {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"},
        "srun forgotten",
    ),
    ("salloc shell", {"SLURM_JOB_ID": "9", "SLURM_NNODES": "2"}, "srun forgotten"),
    (
        "non-numeric procid",
        _with(SRUN, SLURM_PROCID="three"),
        "SLURM_PROCID='three' is not an integer",
    ),
    ("negative localid", _with(SRUN, SLURM_LOCALID="-1"), "below its minimum"),
    ("rank outside world", _with(SRUN, SLURM_PROCID="4"), "rank 4 is outside its size 4"),
    ("local rank outside", _with(SRUN, SLURM_LOCALID="2"), "local rank 2 is outside its size 2"),
    ("node id outside", _with(SRUN, SLURM_NODEID="2"), "node rank 2 is outside"),
    ("bad node list", _with(SRUN, SLURM_STEP_NODELIST="node[2-1]"), "cannot parse host list"),
    ("bad tasks per node", _with(SRUN, SLURM_STEP_TASKS_PER_NODE="2(x)"), "tasks-per-node"),
    ("tasks sum", _with(SRUN, SLURM_STEP_NUM_TASKS="5"), "inconsistent Slurm step"),
    ("hosts vs nodes", _with(SRUN, SLURM_STEP_NODELIST="node[1-3]"), "inconsistent Slurm step"),
    (
        "no step size",
        _with(SRUN, SLURM_STEP_NUM_TASKS=None, SLURM_NTASKS=None, SLURM_NPROCS=None),
        "step size",
    ),
    ("MASTER_PORT text", _with(SRUN, MASTER_PORT="http"), "MASTER_PORT='http' is not a TCP port"),
    ("MASTER_PORT zero", _with(SRUN, MASTER_PORT="0"), "is not a TCP port"),
    ("MASTER_PORT big", _with(SRUN, MASTER_PORT="65536"), "is not a TCP port"),
    ("RANK by hand", _with(SRUN, RANK="0"), "RANK=0 but SLURM_PROCID=3"),
    ("LOCAL_RANK by hand", _with(SRUN, LOCAL_RANK="0"), "LOCAL_RANK=0 but SLURM_LOCALID=1"),
    ("WORLD_SIZE by hand", _with(SRUN, WORLD_SIZE="8"), "WORLD_SIZE=8 but SLURM_STEP_NUM_TASKS=4"),
    (
        "mpirun in allocation",
        _with(SRUN, OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_RANK="3"),
        "OMPI_COMM_WORLD_SIZE=8",
    ),
    (
        "gpus per node",
        _with(SRUN, SLURM_GPUS_ON_NODE="4"),
        "tasks per node do not match GPUs per node",
    ),
    ("torchrun missing master", _with(TORCHRUN, MASTER_ADDR=None), "MASTER_ADDR/MASTER_PORT"),
    ("torchrun rank outside", _with(TORCHRUN, RANK="2"), "rank 2 is outside its size 2"),
    ("torchrun port", _with(TORCHRUN, MASTER_PORT="-5"), "not a TCP port"),
    ("starter unknown", _with(STARTED, HPC_DDP_STARTED_BY="ssh"), "not a known starter"),
    ("starter no master", _with(STARTED, HPC_DDP_MASTER_ADDR=None), "HPC_DDP_MASTER_ADDR"),
    ("starter no port", _with(STARTED, HPC_DDP_MASTER_PORT=None), "HPC_DDP_MASTER_PORT"),
    ("starter two ports", _with(STARTED, MASTER_PORT="1234"), "disagree"),
    ("starter node outside", _with(STARTED, HPC_DDP_NODE_RANK="2"), "node rank 2 is outside"),
    (
        "launcher missing node",
        _with(STARTED, HPC_DDP_NODE_RANK=None),
        "HPC_DDP_NODE_RANK is not set",
    ),
    ("mpi no master", _with(OMPI, MASTER_ADDR=None), "MASTER_ADDR is not set"),
    ("mpi no local", _with(OMPI, OMPI_COMM_WORLD_LOCAL_RANK=None), "LOCAL_RANK"),
    ("mpi pmix differs", _with(OMPI, PMIX_RANK="0"), "PMIX_RANK=0"),
    ("pmix without size", {"PMIX_RANK": "1"}, "no world size"),
    (
        "mpi no port",
        _with(OMPI, MASTER_PORT=None, OMPI_MCA_ess_base_jobid=None, PMIX_NAMESPACE=None),
        "MASTER_PORT is not set",
    ),
    ("RANK with no launcher", {"RANK": "1", "WORLD_SIZE": "2"}, "no launcher"),
    ("gpus per process env", {"HPC_DDP_GPUS_PER_PROCESS": "two"}, "HPC_DDP_GPUS_PER_PROCESS='two'"),
    ("gpus per process zero", {"HPC_DDP_GPUS_PER_PROCESS": "0"}, "below its minimum 1"),
    (
        "visible GPUs too few",
        _with(SRUN, CUDA_VISIBLE_DEVICES="0,1,2", HPC_DDP_GPUS_PER_PROCESS="2"),
        "more local processes than visible GPUs",
    ),
]


@pytest.mark.parametrize(("name", "environ", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_errors(name: str, environ: dict, message: str, no_gpu_proc: str) -> None:
    with pytest.raises(LaunchEnvError) as err:
        detect_env(environ, proc_root=no_gpu_proc)
    assert message in err.value.message, err.value.message
    assert err.value.hint, "every launch error needs a HINT"
    assert "HINT: " in str(err.value)


def test_gpus_per_process_argument_conflicts_with_env(no_gpu_proc: str) -> None:
    with pytest.raises(LaunchEnvError, match="says otherwise"):
        detect_env({"HPC_DDP_GPUS_PER_PROCESS": "2"}, gpus_per_process=1, proc_root=no_gpu_proc)
    with pytest.raises(LaunchEnvError, match="at least 1"):
        detect_env({}, gpus_per_process=0, proc_root=no_gpu_proc)


# ---- precedence --------------------------------------------------------------------------


def test_precedence_is_one_list() -> None:
    names = [m.__name__.rsplit(".", 1)[1] for m in PRECEDENCE]
    assert names == ["torchrun", "launch_contract", "submitit_local", "slurm", "mpi", "single"]


@pytest.mark.parametrize(
    ("environ", "source"),
    [
        ({}, "single"),
        (SRUN, "slurm"),
        (_with(SRUN, TORCHELASTIC_RUN_ID="x", RANK="0"), "torchrun"),  # srun torchrun
        (_with(SRUN, PMIX_RANK="3"), "slurm"),  # srun --mpi=pmix
        (OMPI, "mpi"),
        (_with(STARTED, TORCHELASTIC_RUN_ID="x"), "torchrun"),  # pdsh runs torchrun per node
        (STARTED, "launch_contract"),  # leftover batch-shell SLURM_* beside it
        (_with(TORCHRUN, SUBMITIT_LOCAL_JOB_ID="1"), "torchrun"),
        (
            {
                "SUBMITIT_LOCAL_JOB_ID": "1",
                "SLURM_JOB_ID": "5",
                "SLURM_NTASKS": "4",
                "SLURM_PROCID": "0",
            },
            "submitit_local",  # LocalExecutor started from inside a batch script
        ),
    ],
)
def test_precedence(environ: dict, source: str) -> None:
    assert detect_source(environ).__name__.endswith("." + source)


def test_srun_torchrun_rank_is_torchruns(no_gpu_proc: str) -> None:
    capture = json.loads((ENVS / "slurm_srun_torchrun.json").read_text())["processes"][3]["environ"]
    assert capture["SLURM_PROCID"] == "1" and capture["RANK"] == "3"
    env = detect_env(capture, proc_root=no_gpu_proc)
    assert (env.source, env.rank, env.node_rank, env.job_id) == ("torchrun", 3, 1, "10")


def test_single_process(no_gpu_proc: str) -> None:
    env = detect_env({}, proc_root=no_gpu_proc)
    assert (env.source, env.rank, env.world_size, env.master_addr) == ("single", 0, 1, "127.0.0.1")
    assert 1 <= env.master_port <= 65535 and env.gpus == ()
    explicit = detect_env(
        {"MASTER_PORT": "12345", "RANK": "0", "WORLD_SIZE": "1"}, proc_root=no_gpu_proc
    )
    assert explicit.master_port == 12345


def test_one_task_batch_job_is_a_single_process(no_gpu_proc: str) -> None:
    env = detect_env(
        {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, proc_root=no_gpu_proc
    )
    assert (env.source, env.world_size, env.job_id, env.master_port) == (
        "slurm",
        1,
        "42",
        derive_port("42"),
    )


def test_slurm_master_is_first_host_in_slurm_order(no_gpu_proc: str) -> None:
    env = detect_env(
        _with(
            SRUN,
            SLURM_STEP_NODELIST="zeta9,alpha[2,1]",
            SLURM_STEP_NUM_NODES="3",
            SLURM_STEP_TASKS_PER_NODE="2,1(x2)",
            SLURM_NODEID="0",
            SLURM_PROCID="1",
            SLURMD_NODENAME="zeta9",
        ),
        proc_root=no_gpu_proc,
    )
    assert env.master_addr == "zeta9" and env.local_world_size == 2


def test_explicit_master_wins(no_gpu_proc: str) -> None:
    env = detect_env(
        _with(SRUN, MASTER_ADDR="node1-ib", MASTER_PORT="31000"), proc_root=no_gpu_proc
    )
    assert (env.master_addr, env.master_port) == ("node1-ib", 31000)


# ---- a launcher inside a one-task Slurm job -----------------------------------------------

# The shell of a one-task job, where another launcher is started: `sbatch -n1` / `salloc -N1`
# (SLURM_NTASKS unset without -n), and salloc's interactive step (a step of one task).
ONE_TASK_SHELLS = {
    "batch -n1": {"SLURM_JOB_ID": "777", "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "1"},
    "salloc -N1": {"SLURM_JOB_ID": "777", "SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1"},
    "interactive step": {
        "SLURM_JOB_ID": "777",
        "SLURM_NTASKS": "1",
        "SLURM_STEP_ID": "4294967290",
        "SLURM_PROCID": "0",
    },
}
# What each inner launcher leaves in its workers (DeepSpeed's launcher and the legacy
# torch.distributed.launch set no torchrun markers; MPI cannot be faked better: no MPI here).
TORCH_LIKE = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
INNER_LAUNCHERS = {
    "deepspeed": ({**TORCH_LIKE, "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}, "RANK=3 "),
    "deepspeed rank 0": ({**TORCH_LIKE, "RANK": "0", "WORLD_SIZE": "8"}, "WORLD_SIZE=8 are set"),
    "legacy launch": ({**TORCH_LIKE, "RANK": "1", "WORLD_SIZE": "2"}, "RANK=1 WORLD_SIZE=2"),
    "open mpi": (
        {
            "OMPI_COMM_WORLD_RANK": "3",
            "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "MASTER_ADDR": "127.0.0.1",
        },
        "OMPI_COMM_WORLD_RANK=3 OMPI_COMM_WORLD_SIZE=4 are set",
    ),
    "mpich hydra": ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "PMI_RANK=0 PMI_SIZE=2 are set"),
    "pmix": ({"PMIX_RANK": "2"}, "PMIX_RANK=2 is set"),
}


@pytest.mark.parametrize("shell", ONE_TASK_SHELLS)
@pytest.mark.parametrize("inner", INNER_LAUNCHERS)
def test_launcher_inside_a_one_task_job_is_a_contradiction(
    shell: str, inner: str, no_gpu_proc: str
) -> None:
    """Each worker read Slurm's single task and went on as rank 0 of 1 (outside Slurm the same
    variables were refused): now they are named, with the fix."""
    variables, shown = INNER_LAUNCHERS[inner]
    with pytest.raises(LaunchEnvError) as err:
        detect_env({**ONE_TASK_SHELLS[shell], **variables}, proc_root=no_gpu_proc)
    assert shown in err.value.message and "in Slurm job 777" in err.value.message
    assert "neither an srun task" in err.value.message
    assert err.value.hint and "srun" in err.value.hint


def test_launcher_inside_a_job_is_named_before_srun_forgotten(no_gpu_proc: str) -> None:
    """mpirun in `sbatch -n4`: its ranks are what went wrong, not a forgotten srun. Variables
    that agree with one process stay valid in a one-task job."""
    mpirun = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "n1"}
    shell = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}
    with pytest.raises(LaunchEnvError, match="OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=4"):
        detect_env({**shell, **mpirun}, proc_root=no_gpu_proc)
    agree = {**ONE_TASK_SHELLS["batch -n1"], "RANK": "0", "WORLD_SIZE": "1", "PMI_SIZE": "1"}
    env = detect_env(agree, proc_root=no_gpu_proc)
    assert (env.source, env.rank, env.world_size) == ("slurm", 0, 1)


# ---- heterogeneous steps -------------------------------------------------------------------

# `srun --het-group=0,1`: component 0 is gpu01 (2 tasks), component 1 cpu01 and cpu02 (1 each);
# tests/test_env_command.py runs the same step through the real command.
# srun sorted the joint node list and its tasks per node; SLURM_NODEID counts component 0 first.
HET_STEP = {
    "SLURM_JOB_ID": "500",
    "SLURM_STEP_ID": "0",
    "SLURM_HET_SIZE": "2",
    "SLURM_STEP_NODELIST": "cpu[01-02],gpu01",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2),2",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "3",
}
HET_GROUPS = {
    "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu01",
    "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu0[1-2]",
}
# (SLURM_PROCID, SLURM_NODEID, SLURM_LOCALID, SLURMD_NODENAME) of each task, as slurmstepd sets.
HET_TASKS = [(0, 0, 0, "gpu01"), (1, 0, 1, "gpu01"), (2, 1, 0, "cpu01"), (3, 2, 0, "cpu02")]


def _task(base: dict, procid: int, nodeid: int, localid: int, host: str, **extra: str) -> dict:
    ids = {"SLURM_PROCID": str(procid), "SLURM_NODEID": str(nodeid), "SLURM_LOCALID": str(localid)}
    return {**base, **ids, "SLURMD_NODENAME": host, **extra}


def test_het_step_without_component_lists_is_refused(no_gpu_proc: str) -> None:
    """Task 0 of the step read cpu01 as MASTER_ADDR and 1 process on its node (it has 2)."""
    environ = {**HET_STEP, "SLURM_PROCID": "0", "SLURM_NODEID": "0", "SLURM_LOCALID": "0"}
    with pytest.raises(LaunchEnvError) as err:
        detect_env(environ, proc_root=no_gpu_proc)
    message = err.value.message
    assert "SLURM_HET_SIZE=2" in message and "SLURM_NODEID" in message
    assert "SLURM_JOB_NODELIST_HET_GROUP_0, SLURM_JOB_NODELIST_HET_GROUP_1" in message
    assert err.value.hint


@pytest.mark.parametrize("spelling", ["HET_GROUP", "PACK_GROUP"])
def test_het_step_nodes_in_component_order(spelling: str, no_gpu_proc: str) -> None:
    """sbatch/salloc set _HET_GROUP_<n> and _PACK_GROUP_<n>, srun's own allocation only the
    second. Every task agrees on component 0's first node and counts its own node's tasks."""
    groups = {k.replace("HET_GROUP", spelling): v for k, v in HET_GROUPS.items()}
    envs = [
        detect_env(_task({**HET_STEP, **groups}, *task), proc_root=no_gpu_proc)
        for task in HET_TASKS
    ]
    assert {(e.master_addr, e.world_size, e.num_nodes) for e in envs} == {("gpu01", 4, 3)}
    assert [(e.rank, e.node_rank, e.local_rank, e.local_world_size) for e in envs] == [
        (0, 0, 0, 2),
        (1, 0, 1, 2),
        (2, 1, 0, 1),
        (3, 2, 0, 1),
    ]
    # An exported MASTER_ADDR is kept; the node sizes still come from component order.
    mine = detect_env(_task({**HET_STEP, **groups}, *HET_TASKS[3], MASTER_ADDR="gpu01-ib"))
    assert (mine.master_addr, mine.local_world_size) == ("gpu01-ib", 1)
    # A step of component 1 alone in the same job: its own list, in its own order.
    alone = {**HET_STEP, **groups, "SLURM_STEP_NODELIST": "cpu0[1-2]"}
    alone |= {"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NUM_TASKS": "2"}
    alone |= {"SLURM_STEP_NUM_NODES": "2"}
    env = detect_env(_task(alone, 1, 1, 0, "cpu02"), proc_root=no_gpu_proc)
    assert (env.master_addr, env.rank, env.node_rank, env.world_size) == ("cpu01", 1, 1, 2)


HET_CONTRADICTIONS = [
    (
        "host in two components",
        _task(
            {**HET_STEP, **HET_GROUPS, "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu01,cpu01"},
            *HET_TASKS[0],
        ),
        "cpu01 is in the node lists of components 0 and 1",
    ),
    (
        "host in no component",
        _task({**HET_STEP, **HET_GROUPS, "SLURM_JOB_NODELIST_HET_GROUP_1": "cpu01"}, *HET_TASKS[0]),
        "cpu02 of SLURM_STEP_NODELIST='cpu[01-02],gpu01' is in no component's node list",
    ),
    (
        "task on another node",
        _task({**HET_STEP, **HET_GROUPS}, 0, 0, 0, "cpu01"),
        "this task runs on SLURMD_NODENAME='cpu01', but SLURM_NODEID=0 is 'gpu01'",
    ),
    # `srun A : B` inside an ordinary job: no SLURM_HET_SIZE, no component lists.
    (
        "het step in an ordinary job",
        _task({k: v for k, v in HET_STEP.items() if k != "SLURM_HET_SIZE"}, *HET_TASKS[0]),
        "this task runs on SLURMD_NODENAME='gpu01', but SLURM_NODEID=0 is 'cpu01'",
    ),
]


@pytest.mark.parametrize(
    ("name", "environ", "message"), HET_CONTRADICTIONS, ids=[c[0] for c in HET_CONTRADICTIONS]
)
def test_het_step_contradictions(name: str, environ: dict, message: str, no_gpu_proc: str) -> None:
    with pytest.raises(LaunchEnvError) as err:
        detect_env(environ, proc_root=no_gpu_proc)
    assert message in err.value.message, err.value.message
    assert err.value.hint


# ---- srun --distribution=arbitrary ----------------------------------------------------------

# `SLURM_HOSTFILE=<node2, node1, node1> srun -m arbitrary -n3` (the real slurm_srun_arbitrary_w
# capture without its -w): the node list stays node[1-2], task 0 runs on node2 (SLURM_NODEID 1).
ARBITRARY = {
    "SLURM_JOB_ID": "61",
    "SLURM_STEP_ID": "0",
    "SLURM_DISTRIBUTION": "arbitrary",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "2,1",
    "SLURM_STEP_NUM_TASKS": "3",
    "SLURM_STEP_NUM_NODES": "2",
}
ARBITRARY_TASKS = [(0, 1, 0, "node2"), (1, 0, 0, "node1"), (2, 0, 1, "node1")]


@pytest.mark.parametrize(
    "hostfile",
    [
        "node2\nnode1\nnode1\n",
        "node2,node1*2",  # Slurm's other forms: commas, name*N
        "# task 0\nnode2 # rank 0\n\n  node1  \r\nnode1\nnode1\nnode3\n",  # more than needed
    ],
    ids=["lines", "commas and repeat", "comments and spare lines"],
)
def test_arbitrary_master_is_the_hostfile_first_host(
    hostfile: str, tmp_path: Path, no_gpu_proc: str
) -> None:
    path = tmp_path / "hosts"
    path.write_text(hostfile)
    base = {**ARBITRARY, "SLURM_HOSTFILE": str(path)}
    envs = [detect_env(_task(base, *task), proc_root=no_gpu_proc) for task in ARBITRARY_TASKS]
    assert {e.master_addr for e in envs} == {"node2"}
    assert [(e.rank, e.node_rank, e.local_world_size) for e in envs] == [
        (0, 1, 1),
        (1, 0, 2),
        (2, 0, 2),
    ]
    # An exported MASTER_ADDR wins; the hostfile is not read then.
    explicit = {**base, "SLURM_HOSTFILE": str(tmp_path / "absent"), "MASTER_ADDR": "node2-ib"}
    assert detect_env(_task(explicit, *ARBITRARY_TASKS[1])).master_addr == "node2-ib"


ARBITRARY_REFUSED = [
    ("no hostfile", None, 0, "SLURM_HOSTFILE is not set in this task"),
    ("missing file", "", 0, "cannot be read here (No such file or directory)"),
    (
        "counts differ",
        "node1\nnode2\nnode2\n",
        1,
        "places 1 task(s) on node1, the step runs 2 there",
    ),
    (
        "this task elsewhere",
        "node1\nnode2\nnode1\n",
        0,
        "places task 0 on node1, which runs on node2",
    ),
    ("too few hosts", "node2\nnode1\n", 2, "names 2 task(s), not the step's 3"),
    ("not a host", "node2\n$(reboot)\nnode1\n", 1, "holds '$(reboot)' on line 2"),
    ("zero repeat", "node2*0,node1*2\n", 0, "holds 'node2*0' on line 1"),
]


@pytest.mark.parametrize(
    ("name", "content", "task", "message"), ARBITRARY_REFUSED, ids=[c[0] for c in ARBITRARY_REFUSED]
)
def test_arbitrary_without_a_matching_hostfile_is_refused(
    name: str, content: str | None, task: int, message: str, tmp_path: Path, no_gpu_proc: str
) -> None:
    """Rank 0 ran elsewhere than the node list's first host, which every task took as master."""
    environ = _task(ARBITRARY, *ARBITRARY_TASKS[task])
    if content is not None:
        path = tmp_path / "hosts"
        if content:
            path.write_text(content)
        environ["SLURM_HOSTFILE"] = str(path)
    with pytest.raises(LaunchEnvError) as err:
        detect_env(environ, proc_root=no_gpu_proc)
    assert message in err.value.message, err.value.message
    assert "SLURM_DISTRIBUTION=arbitrary" in err.value.message
    assert err.value.hint and "MASTER_ADDR" in err.value.hint


# ---- ports -------------------------------------------------------------------------------


def test_derived_port_range_and_determinism() -> None:
    ports = {derive_port(str(job)) for job in range(0, 40000, 7)}
    assert min(ports) >= PORT_BASE and max(ports) < PORT_BASE + PORT_SPAN < 32768
    assert not ports & {29400, 29500}
    assert derive_port("123456") == derive_port("123456") == PORT_BASE + 123456 % PORT_SPAN
    assert PORT_BASE <= derive_port("prterun-n1-4242@1") < PORT_BASE + PORT_SPAN
    # Only ids congruent modulo the span collide (documented trade-off).
    assert derive_port("1") == derive_port(str(1 + PORT_SPAN)) != derive_port("2")


# ---- GPUs --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "entries"),
    [
        ("0,1", ["0", "1"]),
        ("", []),
        ("-1", []),
        ("0,-1,1", ["0"]),  # CUDA stops at the first invalid entry
        ("NoDevFiles", []),
        (
            "GPU-8f6d1c2e-aaaa-bbbb-cccc-1234567890ab,MIG-1b2c",
            ["GPU-8f6d1c2e-aaaa-bbbb-cccc-1234567890ab", "MIG-1b2c"],
        ),
        (" 2 , 3 ", ["2", "3"]),
        ("\u00b2", []),  # isdigit() says yes, int() refuses: an invalid entry, as for CUDA
        ("0,\u0661", ["0"]),
    ],
)
def test_visible_devices(value: str, entries: list[str]) -> None:
    assert parse_visible_devices(value) == entries


def test_visible_count_from_driver_when_unset(tmp_path: Path) -> None:
    proc = fake_gpu_proc(tmp_path, 4)
    assert count_visible_gpus({}, proc) == 4
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": "3"}, proc) == 1
    assert count_visible_gpus({}, str(tmp_path / "nothing")) == 0


@pytest.mark.parametrize(
    ("local_rank", "local_world", "gpp", "visible", "gpus"),
    [
        (0, 2, 1, 0, ()),  # CPU
        (1, 2, 1, 1, (0,)),  # --gpus-per-task=1: each task sees only its own GPU, as 0
        (1, 2, 1, 2, (1,)),  # every task sees both: slice by local rank
        (3, 4, 1, 8, (3,)),  # more visible than needed: still one each
        (0, 1, 4, 4, (0, 1, 2, 3)),  # one process drives the node's 4 GPUs
        (1, 2, 2, 4, (2, 3)),  # two processes x two GPUs
        (1, 2, 2, 2, (0, 1)),  # Slurm already restricted this task to its two GPUs
    ],
)
def test_assign_gpus(
    local_rank: int, local_world: int, gpp: int, visible: int, gpus: tuple
) -> None:
    assert (
        assign_gpus(
            local_rank=local_rank,
            local_world_size=local_world,
            gpus_per_process=gpp,
            visible=visible,
        )
        == gpus
    )


@pytest.mark.parametrize(("local_world", "gpp", "visible"), [(4, 1, 2), (2, 2, 3), (3, 1, 2)])
def test_assign_gpus_too_few(local_world: int, gpp: int, visible: int) -> None:
    with pytest.raises(LaunchEnvError, match="more local processes than visible GPUs") as err:
        assign_gpus(
            local_rank=0, local_world_size=local_world, gpus_per_process=gpp, visible=visible
        )
    assert err.value.hint


def test_fake_gpu_host_torchrun(tmp_path: Path) -> None:
    """torchrun with 2 workers on a (faked) 2-GPU host without CUDA_VISIBLE_DEVICES."""
    env = detect_env(TORCHRUN, proc_root=fake_gpu_proc(tmp_path, 2))
    assert env.gpus == (1,) and env.layout == "1 node x 2 processes x 1 GPU (2 in all)"


def test_visible_gpus_argument_overrides(no_gpu_proc: str) -> None:
    assert detect_env(TORCHRUN, visible_gpus=2, proc_root=no_gpu_proc).gpus == (1,)
    assert detect_env(TORCHRUN, visible_gpus=0, proc_root=no_gpu_proc).gpus == ()


def test_one_process_per_node_from_env_var(no_gpu_proc: str) -> None:
    capture = json.loads((ENVS / "slurm_srun_one_process_per_node_2gpus.json").read_text())
    environ = dict(capture["processes"][1]["environ"], HPC_DDP_GPUS_PER_PROCESS="2")
    env = detect_env(environ, proc_root=no_gpu_proc)
    assert (env.rank, env.world_size, env.node_rank, env.gpus, env.gpus_per_process) == (
        1,
        2,
        1,
        (0, 1),
        2,
    )
    with pytest.raises(LaunchEnvError, match="tasks per node do not match GPUs per node"):
        detect_env(capture["processes"][1]["environ"], proc_root=no_gpu_proc)  # forgot gpp=2


# ---- DistEnv -----------------------------------------------------------------------------


def test_torch_env_and_json() -> None:
    env = DistEnv("slurm", 3, 1, 4, 2, 1, 2, "node1", 20001, "1", (1,), 1)
    assert env.torch_env() == {
        "MASTER_ADDR": "node1",
        "MASTER_PORT": "20001",
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
    }
    data = json.loads(json.dumps(env.to_json()))
    assert data["gpus"] == [1] and data["layout"] == "2 nodes x 2 processes x 1 GPU (4 in all)"
    with pytest.raises(AttributeError):
        env.rank = 0  # type: ignore[misc]
