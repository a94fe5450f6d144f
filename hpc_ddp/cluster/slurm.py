"""Slurm, one process per srun task.

Step-level variables come first: a step (``srun -N2 -n2`` inside a 3-node job) can be smaller
than the allocation, and only SLURM_STEP_* describe the processes that actually run.

Where the tasks run, when the node list is not in task order (heterogeneous steps,
``--distribution=arbitrary``), is :mod:`hpc_ddp.cluster.slurm_nodes`'s.

The batch script itself also has SLURM_PROCID=0, so the step id tells a forgotten ``srun``
apart from task 0. Each spelling of a special step's id must read as one, because the releases
differ: the batch script has no SLURM_STEP_ID at all (22.05) or its id printed as a signed
number ("-5", 26.05); srun prints a step's id unsigned ("4294967290" for the interactive step of
``salloc`` with use_interactive_step); Slurm's own tools name them batch/extern/interactive/TBD.
The ids are near 2**32 (slurm.h: SLURM_BATCH_SCRIPT 0xfffffffb, SLURM_EXTERN_CONT 0xfffffffc,
SLURM_PENDING_STEP 0xfffffffd, SLURM_INTERACTIVE_STEP 0xfffffffa; ordinary steps stay below
SLURM_MAX_NORMAL_STEP_ID 0xfffffff0). All of these are "not an srun task".
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from hpc_ddp.cluster._vars import first_int, get_address, get_int, get_opt_int
from hpc_ddp.cluster.distenv import DistEnv
from hpc_ddp.cluster.hostlist import expand_hostlist, expand_tasks_per_node
from hpc_ddp.cluster.master_port import choose_master_port
from hpc_ddp.cluster.single import one_process, other_world
from hpc_ddp.cluster.slurm_nodes import check_this_node, node_order, rank0_host
from hpc_ddp.env_vars import GPUS_PER_PROCESS_VAR
from hpc_ddp.errors import LaunchEnvError

# Other launchers' sizes that, when present beside an srun step, must describe the same world
# (srun --mpi=pmix/pmi2 sets them consistently; mpirun inside an allocation does not).
_MPI_SIZES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_JOB_ID = re.compile(r"[0-9]{1,18}")  # Slurm job ids are numbers, array and het jobs included
_STEP_ID = re.compile(r"-?[0-9]{1,10}")
_MAX_NORMAL_STEP_ID = 0xFFFFFFF0
_SPECIAL_STEPS = {
    0xFFFFFFFA: "interactive",
    0xFFFFFFFB: "batch",
    0xFFFFFFFC: "extern",
    0xFFFFFFFD: "TBD",
}
_STEP_ID_VARS = ("SLURM_STEP_ID", "SLURM_STEPID")


def detect(environ: Mapping[str, str]) -> bool:
    return "SLURM_JOB_ID" in environ or "SLURM_JOBID" in environ


def _job_id(environ: Mapping[str, str]) -> str:
    name = "SLURM_JOB_ID" if environ.get("SLURM_JOB_ID") else "SLURM_JOBID"
    value = environ.get(name, "")
    if not _JOB_ID.fullmatch(value):
        raise LaunchEnvError(
            f"{name}={value!r} is not a Slurm job id (ASCII digits)",
            hint=f"Slurm sets {name} to the job's number; unset it if it was exported by hand",
        )
    return value


def special_step(environ: Mapping[str, str]) -> str | None:
    """The name of the special step this process belongs to (batch, extern, interactive, TBD),
    or None for an ordinary step or no step id at all."""
    for name in _STEP_ID_VARS:
        value = environ.get(name)
        if value is None:
            continue
        if value in _SPECIAL_STEPS.values():
            return value
        if not _STEP_ID.fullmatch(value) or not -(2**31) <= int(value) < 2**32:
            raise LaunchEnvError(
                f"{name}={value!r} is not a Slurm step id",
                hint=f"srun sets {name} to the step's number; unset it if it was exported by hand",
            )
        step = int(value) & 0xFFFFFFFF  # "-5" is 0xfffffffb printed signed
        if step >= _MAX_NORMAL_STEP_ID:
            return _SPECIAL_STEPS.get(step, f"special step {step:#x}")
        return None
    return None


def in_srun_task(environ: Mapping[str, str]) -> bool:
    """True for a task of an ordinary srun step; False for the batch script, an salloc or
    interactive-step shell, or the extern step (see the module docstring)."""
    has_id = any(name in environ for name in _STEP_ID_VARS)
    return has_id and special_step(environ) is None


def _outside_step(environ: Mapping[str, str], gpus_per_process: int) -> DistEnv:
    """The batch script or an salloc shell: fine for a one-task job, a mistake otherwise."""
    job_id = _job_id(environ)
    tasks = first_int(environ, ("SLURM_NTASKS", "SLURM_NPROCS"), minimum=1) or 1
    nodes = first_int(environ, ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"), minimum=1) or 1
    step = special_step(environ)
    why = f"Slurm's {step} step" if step else "no SLURM_STEP_ID"
    # A launcher started inside the job (mpirun, DeepSpeed's, the legacy
    # torch.distributed.launch) left its ranks here; srun and torchrun would have been read
    # first. Slurm's one task would make every one of its processes rank 0 of 1.
    found = other_world(environ)
    if found is not None:
        single = "; read as the job's one task, each of them would be rank 0 of 1"
        raise LaunchEnvError(
            f"{found} in Slurm job {job_id}, but this process is neither an srun task ({why}) "
            "nor a torchrun worker: a launcher hpc-ddp does not read (mpirun, deepspeed, "
            "torch.distributed.launch) started it inside the job, or they were exported by hand"
            + (single if tasks == nodes == 1 else ""),
            hint="start the processes with `srun -n <N>` (`srun --mpi=pmix` for an MPI "
            "program) or with torchrun inside the job; or unset them to run one process",
        )
    if tasks > 1 or nodes > 1:
        where = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        job = f"a job of {tasks} task(s) on {nodes} node(s)" + (f": {where}" if where else "")
        raise LaunchEnvError(
            f"srun forgotten: SLURM_JOB_ID={job_id} is set ({job}), but this process is not an "
            f"srun task ({why}): it is the batch script or an salloc shell itself, "
            f"which would run 1 process instead of {tasks}",
            hint="start the processes with `srun <command>` in the batch script "
            "(to inspect what each task sees: `srun hpc-ddp env`)",
        )
    port = choose_master_port(environ, job_id)
    return one_process(
        environ,
        source="slurm",
        master_port=port.port,
        master_port_origin=port.origin,
        job_id=job_id,
        gpus_per_process=gpus_per_process,
    )


def _check_same(environ: Mapping[str, str], name: str, expected: int, truth: str) -> None:
    value = get_opt_int(environ, name)
    if value is not None and value != expected:
        raise LaunchEnvError(
            f"contradictory variables: {name}={value} but {truth}={expected} in this srun task",
            hint=f"remove the `export {name}=...` from the job script (Slurm's value is used), "
            "or, for mpirun inside an allocation, launch the ranks with `srun --mpi=pmix` instead",
        )


def _check_gpus_per_node(environ: Mapping[str, str], local_world: int, gpp: int) -> None:
    on_node = get_opt_int(environ, "SLURM_GPUS_ON_NODE")
    if not on_node or local_world * gpp == on_node:
        return
    raise LaunchEnvError(
        f"tasks per node do not match GPUs per node: {local_world} task(s) on this node x "
        f"{gpp} GPU(s) per process = {local_world * gpp}, but the job has {on_node} GPU(s) here "
        "(SLURM_GPUS_ON_NODE)",
        hint=f"use --ntasks-per-node={on_node // gpp} with --gpus-per-node={on_node}, or set "
        f"{GPUS_PER_PROCESS_VAR}={max(on_node // max(local_world, 1), 1)} for one process "
        "driving several GPUs",
    )


def read(environ: Mapping[str, str], *, gpus_per_process: int) -> DistEnv:
    if not in_srun_task(environ):
        return _outside_step(environ, gpus_per_process)
    job_id = _job_id(environ)
    rank = get_int(environ, "SLURM_PROCID")
    local_rank = get_int(environ, "SLURM_LOCALID")
    node_rank = get_int(environ, "SLURM_NODEID")
    world = first_int(environ, ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), minimum=1)
    tpn_text = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    nodelist = (
        environ.get("SLURM_STEP_NODELIST")
        or environ.get("SLURM_JOB_NODELIST")
        or environ.get("SLURM_NODELIST")
    )
    if world is None or tpn_text is None or nodelist is None:
        raise LaunchEnvError(
            "srun task without its step size, tasks per node or node list "
            "(SLURM_STEP_NUM_TASKS, SLURM_STEP_TASKS_PER_NODE, SLURM_STEP_NODELIST)",
            hint="run under a real `srun`; do not export SLURM_PROCID by hand",
        )
    hosts = expand_hostlist(nodelist)
    tasks_per_node = expand_tasks_per_node(tpn_text)
    num_nodes = first_int(
        environ, ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"), minimum=1
    )
    num_nodes = len(hosts) if num_nodes is None else num_nodes
    if not len(hosts) == len(tasks_per_node) == num_nodes or sum(tasks_per_node) != world:
        raise LaunchEnvError(
            f"inconsistent Slurm step: {num_nodes} node(s), node list {nodelist!r} "
            f"({len(hosts)} hosts), tasks per node {tpn_text!r} (sum {sum(tasks_per_node)} on "
            f"{len(tasks_per_node)} nodes), {world} tasks",
            hint="these come from srun; look for SLURM_* variables exported by hand or "
            "inherited from another job",
        )
    if not 0 <= node_rank < num_nodes:
        raise LaunchEnvError(
            f"slurm: node rank {node_rank} is outside the step's {num_nodes} node(s)",
            hint="SLURM_NODEID does not belong to this step; do not export it by hand",
        )
    hosts, tasks_per_node = node_order(environ, hosts, tasks_per_node, nodelist)
    check_this_node(environ, hosts, node_rank, nodelist)
    local_world = tasks_per_node[node_rank]
    _check_same(environ, "RANK", rank, "SLURM_PROCID")
    _check_same(environ, "LOCAL_RANK", local_rank, "SLURM_LOCALID")
    _check_same(environ, "WORLD_SIZE", world, "SLURM_STEP_NUM_TASKS")
    for name in _MPI_SIZES:
        _check_same(environ, name, world, "SLURM_STEP_NUM_TASKS")
    _check_gpus_per_node(environ, local_world, gpus_per_process)
    port = choose_master_port(environ, job_id)
    return DistEnv(
        source="slurm",
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        # An exported MASTER_ADDR (e.g. an InfiniBand hostname) is the user's choice; otherwise
        # the host where task 0 runs.
        master_addr=get_address(environ, "MASTER_ADDR")
        or rank0_host(environ, hosts, tasks_per_node, rank=rank, node_rank=node_rank, world=world),
        master_port=port.port,
        job_id=job_id,
        gpus_per_process=gpus_per_process,
        master_port_origin=port.origin,
    )
