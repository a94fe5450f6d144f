"""MPI launchers (mpirun/mpiexec): Open MPI, MPICH/Intel MPI (PMI), MVAPICH2, PMIx.

MPI gives ranks but not a rendezvous address: MASTER_ADDR must be exported (``mpirun -x
MASTER_ADDR=...``) for more than one process. Node rank assumes ranks are placed by slot (Open
MPI's default: consecutive ranks fill a node); with ``--map-by node`` only node_rank is off.
OMPI_COMM_WORLD_NODE_RANK is not read: despite its name it ranks processes within a node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from hpc_ddp.cluster._vars import first_job_id, get_address, get_int, get_opt_int
from hpc_ddp.cluster.distenv import DistEnv
from hpc_ddp.cluster.master_port import choose_master_port
from hpc_ddp.errors import LaunchEnvError


@dataclass(frozen=True)
class Flavor:
    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str


FLAVORS = (
    Flavor(
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    Flavor(
        "MVAPICH2",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
    ),
    Flavor("MPICH/Intel MPI (PMI)", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
)
_JOB_IDS = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE", "PMI_JOBID")


def detect(environ: Mapping[str, str]) -> bool:
    return "PMIX_RANK" in environ or any(f.rank in environ for f in FLAVORS)


def _flavor(environ: Mapping[str, str]) -> Flavor:
    for flavor in FLAVORS:
        if flavor.rank in environ:
            return flavor
    raise LaunchEnvError(
        "PMIX_RANK is set but no world size (OMPI_COMM_WORLD_SIZE, PMI_SIZE) is",
        hint="launch with Open MPI's mpirun, or with srun --mpi=pmix inside a Slurm job",
    )


def read(environ: Mapping[str, str], *, gpus_per_process: int) -> DistEnv:
    flavor = _flavor(environ)
    rank = get_int(environ, flavor.rank)
    world = get_int(environ, flavor.size, minimum=1)
    local_rank = get_opt_int(environ, flavor.local_rank)
    local_world = get_opt_int(environ, flavor.local_size, minimum=1)
    if local_rank is None or local_world is None:
        if world != 1:
            raise LaunchEnvError(
                f"{flavor.name}: {flavor.local_rank}/{flavor.local_size} are not set, so the "
                "process cannot tell which GPU is its own",
                hint="use an MPI launcher that exports local ranks (Open MPI's mpirun does)",
            )
        local_rank, local_world = 0, 1
    pmix_rank = get_opt_int(environ, "PMIX_RANK")
    if pmix_rank is not None and pmix_rank != rank:
        raise LaunchEnvError(
            f"contradictory variables: PMIX_RANK={pmix_rank} but {flavor.rank}={rank}",
            hint="variables from two launches are mixed: check what the job script exports",
        )
    addr = get_address(environ, "MASTER_ADDR")
    if addr is None:
        if world > 1:
            raise LaunchEnvError(
                f"{flavor.name} started {world} processes but MASTER_ADDR is not set: MPI does "
                "not say where rank 0 runs",
                hint="export it to every rank: `mpirun -x MASTER_ADDR=$(hostname) -x "
                "MASTER_PORT=29511 ...`",
            )
        addr = "127.0.0.1"
    job_id = first_job_id(environ, _JOB_IDS)
    if job_id is not None or environ.get("MASTER_PORT"):
        port = choose_master_port(environ, job_id)
    else:
        raise LaunchEnvError(
            f"{flavor.name}: MASTER_PORT is not set and there is no job id to derive it from",
            hint="export it to every rank: `mpirun -x MASTER_PORT=29511 ...`",
        )
    return DistEnv(
        source="mpi",
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=rank // local_world,
        num_nodes=-(-world // local_world),
        master_addr=addr,
        master_port=port.port,
        job_id=job_id,
        gpus_per_process=gpus_per_process,
        master_port_origin=port.origin,
    )
