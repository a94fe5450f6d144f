"""The executors a job can be submitted with, as one table.

Every question ``describe``/``submit``, ``hpc-ddp submit`` and job control ask of an executor is
answered by its entry in ``EXECUTORS``: its backend, whether it runs a ``JobSpec`` or a
``LaunchSpec`` (and whether a rendered batch script), the optional extra it needs, whether it
needs a Slurm cluster, whether submitit runs its jobs (a folder of logs and pickles, USR2 to
checkpoint, this machine's processes for ``local``), how ``hpc-ddp submit`` announces a job
and what its report shows. Adding an executor is a backend and one entry here; the CLI's
``--executor`` choices follow the keys. Backends are imported only when one is built (submitit
is an optional extra). Pure data; torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpc_ddp.deploy.backend import Backend


# Each builds its backend from get_backend's options (cluster_env, folder, cwd, follow,
# produced_by), taking the ones it uses; the import happens only then.
def _sbatch(name: str, **o: Any) -> Backend:
    from hpc_ddp.deploy.sbatch.backend import SbatchBackend

    return SbatchBackend(
        cluster_env=o["cluster_env"], cwd=o["cwd"], follow=o["follow"], produced_by=o["produced_by"]
    )


def _submitit(name: str, **o: Any) -> Backend:
    from hpc_ddp.deploy.submitit.backend import SubmititBackend

    kind: Any = name  # the executor's name is submitit's kind: submitit or local
    return SubmititBackend(
        kind, folder=o["folder"], cluster_env=o["cluster_env"], cwd=o["cwd"], follow=o["follow"]
    )


def _shell(name: str, **o: Any) -> Backend:
    from hpc_ddp.deploy.shell.backend import ShellBackend

    return ShellBackend(stdout=o["follow"], stderr=o["follow"], produced_by=o["produced_by"])


@dataclass(frozen=True)
class ExecutorInfo:
    """One way to run a job, and what the code around its backend needs to know of it."""

    name: str
    # Builds the backend (name, then get_backend's options); imports it only then.
    backend: Callable[..., Backend]
    # True: it runs a LaunchSpec (hpc-ddp launch), whose tool it is; False: a JobSpec.
    launch_spec: bool = False
    # Whether it also submits a rendered batch script (jobs/*.sbatch), not only a spec.
    batch_script: bool = False
    # The optional extra (hpc_ddp.extras) it needs, checked before its backend is built.
    extra: str | None = None
    # Whether its jobs go to a Slurm cluster (hpc-ddp submit starts the embedded one if none).
    needs_slurm: bool = True
    # Whether submitit runs its jobs: each has a folder of logs and pickles, and its processes
    # checkpoint on submitit's signal.
    submitit: bool = False
    # Whether its jobs are processes of this machine, which a cancel stops itself (no scancel).
    this_machine: bool = False
    # hpc-ddp submit's line once the job is in: str.format'ed with executor, job_id, log (the
    # job's output) and folder (its submitit folder).
    submitted: str = "submitted {executor} job {job_id}; logs in {folder}"
    # What hpc-ddp submit's report shows: True, a batch job's (its restarts, and why there is
    # no result.json); False, a submitit task's (rank 0's return value carries the result, its
    # error is shown).
    batch_report: bool = False


EXECUTORS: Mapping[str, ExecutorInfo] = MappingProxyType(
    {
        "sbatch": ExecutorInfo(
            "sbatch",
            _sbatch,
            batch_script=True,
            submitted="submitted job {job_id}; log: {log}",
            batch_report=True,
        ),
        "submitit": ExecutorInfo("submitit", _submitit, extra="submitit", submitit=True),
        "local": ExecutorInfo(
            "local",
            _submitit,
            extra="submitit",
            needs_slurm=False,
            submitit=True,
            this_machine=True,
        ),
        "pdsh": ExecutorInfo("pdsh", _shell, launch_spec=True, needs_slurm=False),
        "clush": ExecutorInfo("clush", _shell, launch_spec=True, needs_slurm=False),
    }
)
# Other names of an executor: "slurm" is submitit's AutoExecutor on the Slurm cluster.
ALIASES: Mapping[str, str] = MappingProxyType({"slurm": "submitit"})
# Every name an executor is known by, each alias right after the executor it names.
EXECUTOR_NAMES: tuple[str, ...] = tuple(
    alias
    for name in EXECUTORS
    for alias in (name, *(other for other, same in ALIASES.items() if same == name))
)


def canonical(name: str) -> str:
    """The executor ``name`` stands for (an alias's executor; any other name as it is)."""
    return ALIASES.get(name, name) if isinstance(name, str) else name


def executor_info(name: str) -> ExecutorInfo | None:
    """The entry of the executor ``name`` (or an alias) stands for; None for no executor."""
    return EXECUTORS.get(canonical(name)) if isinstance(name, str) else None
