"""The launchers a Slurm job (``JobSpec.launcher``) can start its processes with, as one table.

Every question the spec's checks, the sbatch renderer, submitit and the job summary ask of a
launcher is answered by its entry in ``LAUNCHERS``: its template, how many Slurm tasks a node
runs and what one task is given, how the batch shell learns that the job should be requeued,
the words of the training step, and the spec options it cannot honour (with the message that
refuses them). Adding a launcher is a template and one entry here. Pure data; torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING

from hpc_ddp.env_vars import REQUEUE_BY_BATCH, REQUEUE_BY_BATCH_MARKER

if TYPE_CHECKING:
    from hpc_ddp.deploy.spec import JobSpec


@dataclass(frozen=True)
class SlurmLauncher:
    """One way a job's step starts the training processes."""

    name: str
    template: str  # under templates/: the batch script this launcher's jobs render to
    help: str  # what one Slurm task is, for the JobSpec field's help
    # True: one Slurm task per node, which starts that node's processes itself (and gets their
    # CPUs and GPUs); False: one Slurm task per process.
    task_per_node: bool
    # How the trainer leaves the requeue to the batch shell (hpc_ddp.env_vars): by exit status,
    # or by a marker file in the run dir where the launcher does not pass its workers' status on.
    requeue_by: str
    # The words of the step after srun's own options (the container's exec words, if any, come
    # first unless the template puts them in front of each worker: exec_in_template).
    step_argv: Callable[[JobSpec], list[str]]
    exec_in_template: bool = False
    # The spec's layout when the launcher fixes it (else the GPUs decide: per-gpu, per-node, cpu).
    layout: str | None = None
    # The launcher's own program, whose interpreter runs the workers (None: the spec's python).
    runs_python: str | None = None
    # The most GPUs one process may drive (None: any), and boolean spec options it cannot
    # honour, each with the refusal.
    max_gpus_per_process: int | None = None
    refused_options: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # submitit starts one task per process itself: only a launcher that does the same fits.
    by_submitit: bool = False

    @property
    def reads_marker(self) -> bool:
        """Whether the batch shell requeues only on the trainer's marker in the run dir."""
        return self.requeue_by == REQUEUE_BY_BATCH_MARKER

    def tasks_per_node(self, spec: JobSpec) -> int:
        return 1 if self.task_per_node else spec.ppn

    def processes_per_task(self, spec: JobSpec) -> int:
        return spec.ppn if self.task_per_node else 1

    def gpus_per_task(self, spec: JobSpec) -> int:
        """srun's --gpus-per-task: a node's GPUs for a task per node, else one process's."""
        return spec.gpus_per_node if self.task_per_node else spec.gpus_per_process

    def task_cpus(self, spec: JobSpec) -> int:
        """CPUs of one Slurm task (0 = Slurm's default): a task hosts its processes' CPUs."""
        return spec.cpus_per_task * self.processes_per_task(spec)

    def gpu_problems(self, spec: JobSpec) -> list[str]:
        """A process driving more GPUs than this launcher gives one (numbers in range only)."""
        limit = self.max_gpus_per_process
        if limit is None or spec.gpus_per_process <= limit:
            return []
        able = ", ".join(f'"{n}"' for n, ln in LAUNCHERS.items() if ln.max_gpus_per_process is None)
        return [
            f"launcher {self.name} starts one process per GPU; one process driving "
            f"{spec.gpus_per_process} GPUs needs launcher = {able} (one task per node)"
        ]

    def option_problems(self, spec: JobSpec) -> list[str]:
        """The spec's options this launcher cannot honour, one refusal each."""
        return [why for option, why in self.refused_options.items() if getattr(spec, option)]


def _srun_step(spec: JobSpec) -> list[str]:
    # Through `hpc-ddp exec`: srun sets SLURM_PROCID..., a program written for torchrun
    # reads RANK, WORLD_SIZE, MASTER_ADDR...; exec derives those and becomes the program.
    return [spec.python, "-m", "hpc_ddp", "exec", "--", spec.python, "-u", *spec.program]


def _torchrun_step(spec: JobSpec) -> list[str]:
    # torchrun_task is a shell function the template defines and exports.
    return ["bash", "-c", 'torchrun_task "$@"', "torchrun", *spec.program]


DEFAULT_LAUNCHER = "srun"
LAUNCHERS: Mapping[str, SlurmLauncher] = MappingProxyType(
    {
        "srun": SlurmLauncher(
            name="srun",
            template="srun.sbatch.j2",
            help="srun = one Slurm task per process",
            task_per_node=False,
            requeue_by=REQUEUE_BY_BATCH,
            step_argv=_srun_step,
            by_submitit=True,
        ),
        "torchrun": SlurmLauncher(
            name="torchrun",
            template="torchrun.sbatch.j2",
            help="torchrun = one task per node",
            task_per_node=True,
            # torchrun reports its workers' exit status 75 as 1
            requeue_by=REQUEUE_BY_BATCH_MARKER,
            step_argv=_torchrun_step,
            exec_in_template=True,
            layout="torchrun",
            runs_python="torchrun",
            max_gpus_per_process=1,
            refused_options=MappingProxyType(
                {
                    "resv_ports": "resv_ports needs launcher srun (torchrun's port is chosen "
                    "before any step)",
                    "per_rank_logs": "per_rank_logs needs launcher srun (torchrun writes its "
                    "own per-worker logs)",
                }
            ),
        ),
    }
)


def launcher_running(word: str) -> str:
    """The launcher whose program is ``word`` in a rendered step, else the default one (whose
    step names the interpreter itself)."""
    found = [name for name, ln in LAUNCHERS.items() if ln.runs_python == word]
    return found[0] if found else DEFAULT_LAUNCHER
