"""torchrun / torch elastic: its per-worker variables are the truth, even under ``srun torchrun``
(there SLURM_PROCID numbers the torchrun agents, one per node, not the workers)."""

from __future__ import annotations

from collections.abc import Mapping

from hpc_ddp.cluster._vars import first_job_id, get_address, get_int, get_opt_int
from hpc_ddp.cluster.distenv import DistEnv
from hpc_ddp.cluster.master_port import TORCHRUN_ORIGIN, parse_port
from hpc_ddp.errors import LaunchEnvError


def detect(environ: Mapping[str, str]) -> bool:
    # torchrun always sets TORCHELASTIC_RUN_ID and GROUP_RANK; plain RANK can be set by hand.
    return "TORCHELASTIC_RUN_ID" in environ or "GROUP_RANK" in environ


def read(environ: Mapping[str, str], *, gpus_per_process: int) -> DistEnv:
    rank = get_int(environ, "RANK")
    world = get_int(environ, "WORLD_SIZE", minimum=1)
    local_rank = get_int(environ, "LOCAL_RANK")
    local_world = get_int(environ, "LOCAL_WORLD_SIZE", minimum=1)
    node_rank = get_opt_int(environ, "GROUP_RANK")
    num_nodes = get_opt_int(environ, "GROUP_WORLD_SIZE", minimum=1)
    addr = get_address(environ, "MASTER_ADDR")
    if addr is None or "MASTER_PORT" not in environ:
        raise LaunchEnvError(
            "torchrun variables are present but MASTER_ADDR/MASTER_PORT are not",
            hint="start the script with torchrun itself; do not copy its variables by hand",
        )
    job_id = first_job_id(environ, ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"))
    return DistEnv(
        source="torchrun",
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank if node_rank is not None else rank // local_world,
        num_nodes=num_nodes if num_nodes is not None else -(-world // local_world),
        master_addr=addr,
        master_port=parse_port(environ["MASTER_PORT"]),
        job_id=job_id,
        gpus_per_process=gpus_per_process,
        master_port_origin=TORCHRUN_ORIGIN,
    )
