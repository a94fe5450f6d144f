"""Who am I, who are my peers: one DistEnv from whichever launcher started this process.

Pure Python; never imports torch (``hpc-ddp env`` must answer in well under a second).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from types import ModuleType

from hpc_ddp.cluster import launch_contract, mpi, single, slurm, submitit_local, torchrun
from hpc_ddp.cluster._vars import check_part_of_world, check_rank
from hpc_ddp.cluster.devices import assign_gpus, count_visible_gpus, resolve_gpus_per_process
from hpc_ddp.cluster.distenv import SOURCES, DistEnv
from hpc_ddp.errors import LaunchEnvError

__all__ = ["PRECEDENCE", "SOURCES", "DistEnv", "detect_env", "detect_source", "torch_contract"]

# THE precedence list. Launchers nest (srun starts torchrun, pdsh starts torchrun, sbatch starts
# mpirun or a submitit controller), and a process inherits the variables of every launcher above
# it; the innermost launcher set its variables for this very process, so it is believed first:
# 1. torchrun/elastic: under `srun torchrun` or pdsh+torchrun its per-worker RANK is the truth;
#    SLURM_PROCID there numbers the torchrun agents.
# 2. hpc-ddp's own starters (pdsh/clush, and the fork spawner of --nproc-per-node): started
#    inside an allocation or from a login node, so any SLURM_* beside them are the enclosing
#    shell's leftovers.
# 3. submitit's LocalExecutor: it sets SUBMITIT_LOCAL_* per task; SLURM_* beside them can only
#    be inherited from a batch shell around the local controller (which would read as "srun
#    forgotten"). On a real cluster submitit uses srun and sets no SUBMITIT_LOCAL_*.
# 4. Slurm srun tasks, before MPI: srun --mpi=pmix/pmi2 sets both, consistently; the Slurm reader
#    refuses an MPI world size that disagrees (mpirun inside an allocation).
# 5. MPI (mpirun/mpiexec) outside Slurm.
# 6. Nothing: one process.
PRECEDENCE: tuple[ModuleType, ...] = (torchrun, launch_contract, submitit_local, slurm, mpi, single)


def detect_source(environ: Mapping[str, str]) -> ModuleType:
    return next(source for source in PRECEDENCE if source.detect(environ))


def detect_env(
    environ: Mapping[str, str] | None = None,
    *,
    gpus_per_process: int | None = None,
    visible_gpus: int | None = None,
    proc_root: str = "/proc",
) -> DistEnv:
    """The distributed environment of this process; LaunchEnvError (with a HINT) if it is wrong.

    ``gpus_per_process`` None: what the launcher exported, else 1 (the one rule:
    ``devices.resolve_gpus_per_process``). ``visible_gpus`` lets a caller that already imported
    torch pass ``torch.cuda.device_count()``; otherwise the count comes from
    CUDA_VISIBLE_DEVICES or /proc/driver/nvidia/gpus (``proc_root`` for tests).
    """
    environ = os.environ if environ is None else environ
    gpp = resolve_gpus_per_process(gpus_per_process, environ)
    source = detect_source(environ)
    env = source.read(environ, gpus_per_process=gpp)
    assert env.source in SOURCES, env.source
    check_rank("node rank", env.node_rank, env.num_nodes, env.source)
    check_rank("local rank", env.local_rank, env.local_world_size, env.source)
    check_rank("rank", env.rank, env.world_size, env.source)
    check_part_of_world("local world size", env.local_world_size, env.world_size, env.source)
    check_part_of_world("node count", env.num_nodes, env.world_size, env.source)
    visible = count_visible_gpus(environ, proc_root) if visible_gpus is None else visible_gpus
    gpus = assign_gpus(
        local_rank=env.local_rank,
        local_world_size=env.local_world_size,
        gpus_per_process=gpp,
        visible=visible,
    )
    return dataclasses.replace(env, gpus=gpus)


def torch_contract(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torch's env:// variables for this process (``DistEnv.torch_env``), derived from whatever
    launched it, for a program that reads them itself (``init_process_group()`` with no
    arguments, ``LOCAL_RANK`` for its device). A value already set that says otherwise is a
    LaunchEnvError naming both: two launchers disagree, and guessing would start a wrong world.
    """
    environ = os.environ if environ is None else environ
    env = detect_env(environ)
    contract = env.torch_env()
    for key, value in contract.items():
        if environ.get(key, value) != value:
            raise LaunchEnvError(
                f"{key}={environ[key]} is set, but {env.source} says {key}={value}",
                hint=f"unset {key} (an outer launcher's leftover?) or launch with one launcher",
            )
    return contract
