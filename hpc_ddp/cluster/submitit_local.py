"""submitit's LocalExecutor: tasks see SUBMITIT_LOCAL_* (one node, this machine) and no SLURM_*.

(On a real cluster submitit starts tasks with srun, and the Slurm source reads them.)
"""

from __future__ import annotations

from collections.abc import Mapping

from hpc_ddp.cluster._vars import first_job_id, get_address, get_int, get_opt_int
from hpc_ddp.cluster.distenv import DistEnv
from hpc_ddp.cluster.master_port import choose_master_port
from hpc_ddp.errors import LaunchEnvError


def detect(environ: Mapping[str, str]) -> bool:
    return "SUBMITIT_LOCAL_JOB_ID" in environ


def read(environ: Mapping[str, str], *, gpus_per_process: int) -> DistEnv:
    tasks_per_node = get_int(environ, "SUBMITIT_LOCAL_NTASKS", minimum=1)
    num_nodes = get_opt_int(environ, "SUBMITIT_LOCAL_JOB_NUM_NODES", minimum=1) or 1
    job_id = first_job_id(environ, ("SUBMITIT_LOCAL_JOB_ID",))
    if job_id is None:
        raise LaunchEnvError(
            "SUBMITIT_LOCAL_JOB_ID is set but empty",
            hint="submitit's LocalExecutor sets it to the job's id; unset it if it was exported",
        )
    port = choose_master_port(environ, job_id)
    return DistEnv(
        source="submitit",
        rank=get_int(environ, "SUBMITIT_LOCAL_GLOBALID"),
        local_rank=get_int(environ, "SUBMITIT_LOCAL_LOCALID"),
        world_size=tasks_per_node * num_nodes,
        local_world_size=tasks_per_node,
        node_rank=get_opt_int(environ, "SUBMITIT_LOCAL_NODEID") or 0,
        num_nodes=num_nodes,
        master_addr=get_address(environ, "MASTER_ADDR") or "127.0.0.1",
        master_port=port.port,
        job_id=job_id,
        gpus_per_process=gpus_per_process,
        master_port_origin=port.origin,
    )
