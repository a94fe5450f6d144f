"""No launcher at all: one process, rank 0 of 1, on this host."""

from __future__ import annotations

from collections.abc import Mapping

from hpc_ddp.cluster._vars import ascii_int, get_address
from hpc_ddp.cluster.distenv import DistEnv, Source
from hpc_ddp.cluster.master_port import FREE_PORT_ORIGIN, free_port, parse_port
from hpc_ddp.cluster.mpi import FLAVORS
from hpc_ddp.errors import LaunchEnvError


def detect(environ: Mapping[str, str]) -> bool:
    return True


# What other launchers set in each process they start, as (rank, size) pairs: torch's names
# (DeepSpeed's launcher, the legacy torch.distributed.launch, accelerate; torchrun is told apart
# by its own markers) and MPI's. Their values can only be believed from the launcher that set
# them, but in a world of one process they must say rank 0 of 1.
_OTHER_WORLDS = (
    ("RANK", "WORLD_SIZE"),
    *((flavor.rank, flavor.size) for flavor in FLAVORS),
    ("PMIX_RANK", None),
)


def other_world(environ: Mapping[str, str]) -> str | None:
    """``"RANK=3 WORLD_SIZE=8 are set"`` when another launcher's variables say this process is
    not rank 0 of a world of 1; None when they are absent or agree."""
    for rank_name, size_name in _OTHER_WORLDS:
        rank = environ.get(rank_name, "0").strip()
        size = environ.get(size_name, "1").strip() if size_name else "1"
        if rank != "0" or size != "1":
            names = [n for n in (rank_name, size_name) if n is not None and n in environ]
            shown = [f"{n}={_shown(environ[n].strip())}" for n in names]
            return " ".join(shown) + (" are set" if len(shown) > 1 else " is set")
    return None


def _shown(value: str) -> str:
    """A number as it is; anything else quoted and cut (it reaches terminals and logs)."""
    return value if ascii_int(value) is not None else repr(value[:40])


def read(environ: Mapping[str, str], *, gpus_per_process: int) -> DistEnv:
    # RANK/WORLD_SIZE exported by hand with no launcher: believing them would make this process
    # wait for peers nobody starts; ignoring them would silently train alone. Say so instead.
    found = other_world(environ)
    if found is not None:
        raise LaunchEnvError(
            f"{found}, but no launcher (torchrun, srun, mpirun, hpc-ddp launch, "
            "submitit) started this process",
            hint="start the processes with torchrun or srun, or unset RANK and WORLD_SIZE "
            "to run a single process",
        )
    port_text = environ.get("MASTER_PORT")
    # Nobody has to agree on the port of a one-process group: take any free one.
    port = parse_port(port_text) if port_text else free_port()
    return one_process(
        environ,
        source="single",
        master_port=port,
        master_port_origin="MASTER_PORT" if port_text else FREE_PORT_ORIGIN,
        job_id=None,
        gpus_per_process=gpus_per_process,
    )


def one_process(
    environ: Mapping[str, str],
    *,
    source: Source,
    master_port: int,
    master_port_origin: str,
    job_id: str | None,
    gpus_per_process: int,
) -> DistEnv:
    """Rank 0 of a one-process world on this host (no launcher, or a one-task Slurm job's
    batch shell); an exported MASTER_ADDR is kept."""
    return DistEnv(
        source=source,
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        num_nodes=1,
        master_addr=get_address(environ, "MASTER_ADDR") or "127.0.0.1",
        master_port=master_port,
        job_id=job_id,
        gpus_per_process=gpus_per_process,
        master_port_origin=master_port_origin,
    )
