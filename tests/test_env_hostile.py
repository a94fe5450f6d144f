"""Hostile and unusual launcher environments (issue 13, part 6): each must end in a clear
LaunchEnvError naming the variable, never a traceback, a hang or a silently wrong answer.

The base environments are real captures (tests/data/envs); each case breaks one variable the
way a hand-written export, a failed ``$(...)`` or another Slurm version would.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from hpc_ddp.cluster import detect_env, slurm_nodes
from hpc_ddp.cluster.master_port import PORT_BASE, PORT_SPAN, derive_port
from hpc_ddp.errors import LaunchEnvError

ENVS = Path(__file__).parent / "data" / "envs"


def _capture(name: str, index: int) -> dict[str, str]:
    return json.loads((ENVS / f"{name}.json").read_text())["processes"][index]["environ"]


SRUN = _capture("slurm_srun_2x2", 3)  # a real srun task: rank 3 of 4 on node2
TORCHRUN = _capture("torchrun_standalone", 1)
STARTED = _capture("hpc_ddp_pdsh_2x2", 3)
OMPI = _capture("openmpi_mpirun_2x2", 3)
# The real batch shell of a 3-node, 6-task job (Slurm 22.05 gives it no SLURM_STEP_ID).
BATCH = _capture("slurm_batch_shell", 0)


def _with(base: dict, **changes: str) -> dict:
    return {**base, **changes}


HUGE = "n[0-99999][0-99999][0-99999]"


def _het_groups(first: str, second: str) -> dict[str, str]:
    return {"SLURM_JOB_NODELIST_HET_GROUP_0": first, "SLURM_JOB_NODELIST_HET_GROUP_1": second}


@pytest.fixture
def no_gpu_proc(tmp_path: Path) -> str:
    """A /proc without an NVIDIA driver, so the real host's state cannot leak in."""
    return str(tmp_path / "proc")


HOSTILE = [
    # Other scripts' digits: int() reads '\u0663' as 3 and refuses '\u00b3' with a traceback.
    ("procid arabic-indic", _with(SRUN, SLURM_PROCID="\u0663"), "SLURM_PROCID='\u0663' is not"),
    ("job id superscript", _with(SRUN, SLURM_JOB_ID="\u00b3"), "SLURM_JOB_ID='\u00b3' is not"),
    ("job id text", _with(SRUN, SLURM_JOB_ID="1;id"), "is not a Slurm job id"),
    ("port arabic-indic", _with(SRUN, MASTER_PORT="\u0662\u0669\u0665"), "not a TCP port"),
    ("port newline", _with(SRUN, MASTER_PORT="29500\n"), "MASTER_PORT='29500\\n' is not"),
    ("port sign", _with(SRUN, MASTER_PORT="+29500"), "not a TCP port"),
    ("port underscore", _with(SRUN, MASTER_PORT="29_500"), "not a TCP port"),
    ("torchrun local rank", _with(TORCHRUN, LOCAL_RANK="\u0661"), "LOCAL_RANK='\u0661' is not"),
    ("gpp arabic-indic", {"HPC_DDP_GPUS_PER_PROCESS": "\u0662"}, "is not an integer"),
    ("tasks per node digits", _with(SRUN, SLURM_STEP_TASKS_PER_NODE="\u0662(x2)"), "tasks-per"),
    ("node list digits", _with(SRUN, SLURM_STEP_NODELIST="node[\u0661-\u0662]"), "host list"),
    # Empty or hostile addresses from a launcher (or a failed $(...) in the job script).
    ("torchrun empty master", _with(TORCHRUN, MASTER_ADDR=""), "MASTER_ADDR='' is empty"),
    ("srun empty master", _with(SRUN, MASTER_ADDR=""), "MASTER_ADDR='' is empty"),
    ("mpi blank master", _with(OMPI, MASTER_ADDR=" "), "MASTER_ADDR=' ' is empty"),
    ("starter empty master", _with(STARTED, HPC_DDP_MASTER_ADDR=""), "HPC_DDP_MASTER_ADDR=''"),
    (
        "launcher master newline",
        _with(STARTED, HPC_DDP_MASTER_ADDR="node1\nrm -rf /"),
        "is not a host name or IP address",
    ),
    ("master escape", _with(SRUN, MASTER_ADDR="node1\x1b[2J"), "is not a host name"),
    ("master non-ascii", _with(SRUN, MASTER_ADDR="n\u00f6de1"), "is not a host name"),
    # A node's processes outnumbering the world.
    (
        "torchrun local world > world",
        _with(TORCHRUN, LOCAL_WORLD_SIZE="4"),
        "local world size 4 is larger than the world size 2",
    ),
    (
        "mpi local size > size",
        _with(OMPI, OMPI_COMM_WORLD_LOCAL_SIZE="8"),
        "local world size 8 is larger than the world size 4",
    ),
    # Slurm's reserved ports, mangled.
    ("resv ports range", _with(SRUN, SLURM_STEP_RESV_PORTS="70000"), "SLURM_STEP_RESV_PORTS="),
    ("resv ports open", _with(SRUN, SLURM_STEP_RESV_PORTS="12001-"), "reserved ports"),
    ("resv ports backwards", _with(SRUN, SLURM_STEP_RESV_PORTS="12004-12001"), "reserved ports"),
    ("resv ports digits", _with(SRUN, SLURM_STEP_RESV_PORTS="\u0661\u0662"), "reserved ports"),
    ("step id text", _with(SRUN, SLURM_STEP_ID="zero"), "SLURM_STEP_ID='zero' is not a Slurm step"),
    # Launchers' free-text job ids reach terminals and logs: printable ASCII only.
    ("mpi job id escape", _with(OMPI, OMPI_MCA_ess_base_jobid="1\x1b[2J"), "is not a job id"),
    ("torchrun run id space", _with(TORCHRUN, TORCHELASTIC_RUN_ID="a b"), "is not a job id"),
    ("starter job id", _with(STARTED, HPC_DDP_JOB_ID="j\u00f6b"), "HPC_DDP_JOB_ID="),
    ("step id digits", _with(SRUN, SLURM_STEP_ID="\u0660"), "is not a Slurm step id"),
    # Heterogeneous jobs: component counts and lists are read before anything is expanded.
    ("het size huge", _with(SRUN, SLURM_HET_SIZE="1000000"), "at most 128 components"),
    ("het size digits", _with(SRUN, SLURM_HET_SIZE="\u0662"), "SLURM_HET_SIZE='\u0662' is not"),
    (
        "het group list huge",
        _with(SRUN, SLURM_HET_SIZE="2", **_het_groups(HUGE, "node1")),
        "more than 65536 hosts",
    ),
    (
        "het group lists add up",
        _with(SRUN, SLURM_HET_SIZE="2", **_het_groups("a[0-39999]", "b[0-39999]")),
        "name more than 65536 hosts",
    ),
    (
        "het group list text",
        _with(SRUN, SLURM_HET_SIZE="2", **_het_groups("node1;reboot", "node2")),
        "cannot parse host list 'node1;reboot'",
    ),
    # Where this task runs, shown quoted: it reaches terminals and logs.
    (
        "node name escape",
        _with(SRUN, SLURMD_NODENAME="node2\x1b[2J"),
        "SLURMD_NODENAME='node2\\x1b[2J'",
    ),
]


@pytest.mark.parametrize(("name", "environ", "message"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_values_are_named_errors(
    name: str, environ: dict, message: str, no_gpu_proc: str
) -> None:
    with pytest.raises(LaunchEnvError) as err:
        detect_env(environ, proc_root=no_gpu_proc)
    assert message in err.value.message, err.value.message
    assert err.value.hint and "HINT: " in str(err.value)


# What SLURM_STEP_ID holds outside an ordinary srun step (see hpc_ddp/cluster/slurm.py): Slurm
# 26.05 prints special ids signed in the batch script, srun prints them unsigned (the real
# interactive step is the slurm_interactive_step capture), Slurm's tools print names.
SPECIAL_STEP_IDS = {
    "-5": "batch",
    "4294967291": "batch",
    "batch": "batch",
    "-4": "extern",
    "4294967292": "extern",
    "extern": "extern",
    "-6": "interactive",
    "4294967290": "interactive",
    "interactive": "interactive",
    "-3": "TBD",
    "4294967293": "TBD",
    "4294967295": "special step 0xffffffff",
}


@pytest.mark.parametrize(("step_id", "step"), SPECIAL_STEP_IDS.items())
def test_special_steps_are_srun_forgotten_not_rank_0(
    step_id: str, step: str, no_gpu_proc: str
) -> None:
    environ = _with(BATCH, SLURM_STEP_ID=step_id, SLURM_STEPID=step_id)
    with pytest.raises(LaunchEnvError, match="srun forgotten") as err:
        detect_env(environ, proc_root=no_gpu_proc)
    assert f"Slurm's {step} step" in err.value.message and err.value.hint
    # The same shell with an ordinary step id is task 0 of the job.
    env = detect_env(_with(BATCH, SLURM_STEP_ID="0"), proc_root=no_gpu_proc)
    assert (env.source, env.rank, env.world_size) == ("slurm", 0, 6)


@pytest.mark.parametrize(
    ("value", "port"),
    [("12001-12004", 12001), ("30101", 30101), ("12000,12998-12999", 12000), ("1-65535", 1)],
)
def test_slurm_reserved_ports_give_the_master_port(value: str, port: int, no_gpu_proc: str) -> None:
    """Every task of a step sees the same list, so the first port is agreed without talking."""
    env = detect_env(_with(SRUN, SLURM_STEP_RESV_PORTS=value), proc_root=no_gpu_proc)
    assert (env.master_port, env.master_port_origin) == (port, f"SLURM_STEP_RESV_PORTS={value}")


def test_master_port_wins_over_reserved_ports_and_empty_is_unset(no_gpu_proc: str) -> None:
    explicit = _with(SRUN, SLURM_STEP_RESV_PORTS="12001-12004", MASTER_PORT="31000")
    env = detect_env(explicit, proc_root=no_gpu_proc)
    assert (env.master_port, env.master_port_origin) == (31000, "MASTER_PORT")
    env = detect_env(_with(SRUN, SLURM_STEP_RESV_PORTS=""), proc_root=no_gpu_proc)
    assert (env.master_port, env.master_port_origin) == (derive_port("1"), "derived from job id 1")


def test_whitespace_separated_node_list(no_gpu_proc: str) -> None:
    """`scontrol show hostnames` prints one host per line; a list pasted from it is two hosts."""
    env = detect_env(_with(SRUN, SLURM_STEP_NODELIST="node1\nnode2"), proc_root=no_gpu_proc)
    assert (env.master_addr, env.num_nodes, env.rank) == ("node1", 2, 3)


def test_derived_port_of_any_job_id_text() -> None:
    """Ids that are not numbers hash; other scripts' digits and undecodable bytes included."""
    for job_id in ("\u00b3", "\u0661\u0662", "x\udcff", "prterun-n1-4242@1"):
        assert PORT_BASE <= derive_port(job_id) < PORT_BASE + PORT_SPAN


# ---- SLURM_HOSTFILE under srun --distribution=arbitrary --------------------------------------

# The real 2x2 srun task (rank 3 on node2) as if placed by a hostfile.
ARBITRARY = _with(SRUN, SLURM_DISTRIBUTION="arbitrary")


@pytest.mark.parametrize("kind", ["fifo", "device", "link to a device", "directory"])
def test_hostfile_that_is_not_a_file_is_refused_at_once(
    kind: str, tmp_path: Path, no_gpu_proc: str
) -> None:
    """A FIFO nobody writes would block open() forever; /dev/zero never ends. Neither is read."""
    path = tmp_path / "hosts"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "device":
        path = Path("/dev/zero")
    elif kind == "link to a device":
        path.symlink_to("/dev/zero")
    else:
        path.mkdir()
    with pytest.raises(LaunchEnvError) as err:
        detect_env(_with(ARBITRARY, SLURM_HOSTFILE=str(path)), proc_root=no_gpu_proc)
    assert "cannot be read here" in err.value.message and err.value.hint


def test_hostfile_read_is_bounded(
    tmp_path: Path, no_gpu_proc: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the first HOSTFILE_LIMIT bytes are read (a smaller limit here: 64 bytes)."""
    monkeypatch.setattr(slurm_nodes, "HOSTFILE_LIMIT", 64)
    path = tmp_path / "hosts"
    path.write_text("node1\n" + "#" * 200 + "\nnode1\nnode2\nnode2\n")
    with pytest.raises(LaunchEnvError, match="its first 64 bytes name 1 task"):
        detect_env(_with(ARBITRARY, SLURM_HOSTFILE=str(path)), proc_root=no_gpu_proc)
    path.write_text("node1\nnode1\nnode2\nnode2\n" + "#" * 200 + "\n")  # the rest is not needed
    env = detect_env(_with(ARBITRARY, SLURM_HOSTFILE=str(path)), proc_root=no_gpu_proc)
    assert env.master_addr == "node1"


def test_hostfile_repeats_are_counted_not_expanded(tmp_path: Path, no_gpu_proc: str) -> None:
    """`name*N` for two nodes of 999999999 tasks each: a list of 2e9 names would never fit."""
    path = tmp_path / "hosts"
    path.write_text("node2*999999999\nnode1*999999999\n")
    environ = _with(
        ARBITRARY,
        SLURM_HOSTFILE=str(path),
        SLURM_STEP_TASKS_PER_NODE="999999999(x2)",
        SLURM_STEP_NUM_TASKS="1999999998",
        SLURM_PROCID="1999999997",  # the last task: node1's, SLURM_NODEID 0
        SLURM_NODEID="0",
        SLURMD_NODENAME="node1",
    )
    started = time.process_time()
    env = detect_env(environ, proc_root=no_gpu_proc)
    assert time.process_time() - started < 0.5
    assert (env.master_addr, env.rank, env.local_world_size) == ("node2", 1999999997, 999999999)
