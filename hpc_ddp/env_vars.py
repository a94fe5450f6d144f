"""Every ``HPC_DDP_*`` environment variable, named here and nowhere else.

**The launch contract.** The project's own starters (pdsh, clush, spawn) put these in the
environment of each process they start. :func:`launch_environ` is their one writer (the host
script's bash exports are rendered from its result), :mod:`hpc_ddp.cluster.launch_contract`
their reader, and :data:`LAUNCH_VARS` what :mod:`hpc_ddp.deploy.submission_env` removes before
a submission: a job submitted from inside another must not inherit its place in that job.

| variable                   | written by                       | meaning                        |
|----------------------------|----------------------------------|--------------------------------|
| `HPC_DDP_LAUNCH_ID`        | host script                      | the id of an `hpc-ddp launch`  |
| `HPC_DDP_LAUNCH_TAG`       | host script                      | `<launch id>/<host>`: what     |
|                            |                                  | `hpc-ddp launch stop` finds in |
|                            |                                  | /proc/*/environ                |
| `HPC_DDP_GPUS_PER_PROCESS` | host script, spawn, sbatch jobs  | GPUs one process drives: the   |
|                            | of the one-process-per-node      | default of `detect_env`'s      |
|                            | layout                           | `gpus_per_process`             |
| `HPC_DDP_STARTED_BY`       | host script*, spawn              | pdsh, clush or spawn: which    |
|                            |                                  | starter started the process    |
| `HPC_DDP_JOB_ID`           | host script*                     | the job id `DistEnv` reports   |
| `HPC_DDP_NUM_NODES`        | host script*, spawn              | number of nodes                |
| `HPC_DDP_NODE_RANK`        | host script*, spawn              | this node's rank               |
| `HPC_DDP_LOCAL_RANK`       | node agent, spawn                | the process's rank on its node |
| `HPC_DDP_LOCAL_WORLD_SIZE` | host script*, node agent, spawn  | processes per node             |
| `HPC_DDP_MASTER_ADDR`      | host script*, spawn              | rank 0's host                  |
| `HPC_DDP_MASTER_PORT`      | host script*, spawn              | rank 0's port                  |
| `HPC_DDP_RDZV_ENDPOINT`    | sbatch jobs of the torchrun      | torchrun's rendezvous          |
|                            | layout (their batch shell        | host:port; the preflight step  |
|                            | computes it)                     | reads it                       |
| `HPC_DDP_PROCTRACK`        | sbatch jobs of the torchrun      | Slurm's ProctrackType: under   |
|                            | layout (batch shell)             | proctrack/cgroup the task      |
|                            |                                  | shell forwards signals to      |
|                            |                                  | torchrun's workers             |
| `HPC_DDP_REQUEUE_BY`       | sbatch jobs whose batch shell    | `batch`: the trainer leaves    |
|                            | requeues a step that exits 75,   | the requeue to the batch shell |
|                            | or (torchrun layout) that left   | (`batch-marker`: and leaves    |
|                            | the run dir's requeue marker     | the marker in its run dir)     |

* in ``--mode processes`` only: in torchrun mode torchrun gives its workers their variables.
The host script writes the node rank as pdsh/clush's ``%n`` placeholder, which the tool fills in
per host. The node agent is ``hpc_ddp.deploy.shell.node_agent``; spawn is ``hpc_ddp.spawn``.

**Settings.** Read where they apply; the toolkit never writes them.

| variable                   | read by                          | meaning                        |
|----------------------------|----------------------------------|--------------------------------|
| `HPC_DDP_TEMPLATES`        | hpc_ddp.deploy.templating        | render from this directory of  |
|                            |                                  | templates instead              |
| `HPC_DDP_SLURM`            | hpc_ddp.localslurm.embedded      | `local`: the embedded cluster, |
|                            |                                  | even where another Slurm       |
|                            |                                  | answers                        |
| `HPC_DDP_LOCAL_SLURM_DIR`  | hpc_ddp.localslurm.embedded      | the embedded cluster's dir     |
| `HPC_DDP_GRAPH_FUSED_ADAM` | hpc_ddp.train.fast.cuda_graphs   | `0`: Adam's multi-tensor       |
|                            |                                  | kernels in a captured step     |
| `HPC_DDP_GRAPH_ALLREDUCE`  | hpc_ddp.train.fast.cuda_graphs   | `0`: the all-reduce stays out  |
|                            |                                  | of the captured graph          |
| `HPC_DDP_TORCH_CPU_INDEX`  | scripts/install.sh               | the package index of PyTorch's |
|                            |                                  | CPU-only build (a mirror of    |
|                            |                                  | download.pytorch.org/whl/cpu)  |
| `HPC_DDP_MAX_NPROC`        | hpc_ddp.spawn                    | the most workers               |
|                            |                                  | `--nproc-per-node` forks       |
|                            |                                  | without GPUs (default: 4 per   |
|                            |                                  | usable CPU core)               |

Pure standard library: the node agent imports it on hosts where nothing else is known to work.
"""

from __future__ import annotations

from typing import Literal, get_args

# --- the launch contract ------------------------------------------------------------------
LAUNCH_ID_VAR = "HPC_DDP_LAUNCH_ID"
LAUNCH_TAG_VAR = "HPC_DDP_LAUNCH_TAG"
GPUS_PER_PROCESS_VAR = "HPC_DDP_GPUS_PER_PROCESS"
STARTED_BY_VAR = "HPC_DDP_STARTED_BY"
JOB_ID_VAR = "HPC_DDP_JOB_ID"
NUM_NODES_VAR = "HPC_DDP_NUM_NODES"
NODE_RANK_VAR = "HPC_DDP_NODE_RANK"
LOCAL_RANK_VAR = "HPC_DDP_LOCAL_RANK"
LOCAL_WORLD_SIZE_VAR = "HPC_DDP_LOCAL_WORLD_SIZE"
MASTER_ADDR_VAR = "HPC_DDP_MASTER_ADDR"
MASTER_PORT_VAR = "HPC_DDP_MASTER_PORT"
RDZV_ENDPOINT_VAR = "HPC_DDP_RDZV_ENDPOINT"
PROCTRACK_VAR = "HPC_DDP_PROCTRACK"  # spelt in templates/torchrun.sbatch.j2 (a test checks)
# The job's batch shell requeues after the trainer checkpointed (it runs on the host, where
# scontrol exists even when the step runs in a container without it), so the trainer's
# requeue=auto does not ask too: one request per preemption keeps the restart count honest.
# "batch": the shell sees the step's exit 75 (srun layouts). "batch-marker": torchrun reports
# its workers' 75 as 1, so rank 0 also leaves a marker in its run dir, which the shell reads.
REQUEUE_BY_VAR = "HPC_DDP_REQUEUE_BY"
REQUEUE_BY_BATCH = "batch"
REQUEUE_BY_BATCH_MARKER = "batch-marker"

# In the order launch_environ writes them (the order of the host script's export lines).
LAUNCH_VARS: tuple[str, ...] = (
    LAUNCH_ID_VAR,
    LAUNCH_TAG_VAR,
    GPUS_PER_PROCESS_VAR,
    STARTED_BY_VAR,
    JOB_ID_VAR,
    NUM_NODES_VAR,
    NODE_RANK_VAR,
    LOCAL_RANK_VAR,
    LOCAL_WORLD_SIZE_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
    RDZV_ENDPOINT_VAR,
)
# Written by a job's batch shell for its own task shells, never by launch_environ; a job
# submitted from inside must not inherit it either.
JOB_SHELL_VARS: tuple[str, ...] = (PROCTRACK_VAR, REQUEUE_BY_VAR)

# The values of HPC_DDP_STARTED_BY, the toolkit's own starters: how a process reached its host
# without a scheduler (`hpc-ddp launch pdsh|clush`, and the workers that
# `hpc-ddp train --nproc-per-node N` forks, hpc_ddp.spawn). Not a JobSpec's launcher (srun or
# torchrun inside a Slurm job, hpc_ddp.deploy.launchers).
Starter = Literal["pdsh", "clush", "spawn"]
STARTERS: tuple[Starter, ...] = get_args(Starter)

# --- settings -----------------------------------------------------------------------------
TEMPLATES_VAR = "HPC_DDP_TEMPLATES"
SLURM_VAR = "HPC_DDP_SLURM"
LOCAL_SLURM_DIR_VAR = "HPC_DDP_LOCAL_SLURM_DIR"
GRAPH_FUSED_ADAM_VAR = "HPC_DDP_GRAPH_FUSED_ADAM"
GRAPH_ALLREDUCE_VAR = "HPC_DDP_GRAPH_ALLREDUCE"
TORCH_CPU_INDEX_VAR = "HPC_DDP_TORCH_CPU_INDEX"  # spelled again in scripts/install.sh
MAX_NPROC_VAR = "HPC_DDP_MAX_NPROC"

SETTINGS_VARS: tuple[str, ...] = (
    TEMPLATES_VAR,
    SLURM_VAR,
    LOCAL_SLURM_DIR_VAR,
    GRAPH_FUSED_ADAM_VAR,
    GRAPH_ALLREDUCE_VAR,
    TORCH_CPU_INDEX_VAR,
    MAX_NPROC_VAR,
)


def launch_environ(
    *,
    launch_id: str | None = None,
    launch_tag: str | None = None,
    gpus_per_process: int | None = None,
    started_by: Starter | None = None,
    job_id: str | None = None,
    num_nodes: int | None = None,
    node_rank: int | str | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    rdzv_endpoint: str | None = None,
) -> dict[str, str]:
    """The contract variables of one process, for the values given (None: not written), in
    :data:`LAUNCH_VARS` order.

    Each writer gives what it knows: the host script everything but the local rank (the node
    agent adds it per process), the node agent the local rank and size, spawn a whole worker.
    ``node_rank`` may be text the launching tool substitutes (pdsh/clush's ``%n``).
    """
    if started_by is not None and started_by not in STARTERS:
        raise ValueError(f"starter {started_by!r} is not one of {STARTERS}")  # a caller's bug
    values = (
        launch_id,
        launch_tag,
        gpus_per_process,
        started_by,
        job_id,
        num_nodes,
        node_rank,
        local_rank,
        local_world_size,
        master_addr,
        master_port,
        rdzv_endpoint,
    )
    return {
        name: str(value)
        for name, value in zip(LAUNCH_VARS, values, strict=True)
        if value is not None
    }
