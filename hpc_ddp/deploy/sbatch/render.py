"""``render(spec) -> str``: a JobSpec becomes an sbatch script. Pure: reads templates only.

The shell fragments that need quoting are built here with ``shlex`` (quoted once, in one place);
the templates in ``templates/`` only arrange them and carry the comments a reader of the job needs.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from hpc_ddp import __version__
from hpc_ddp.deploy.container import (
    apptainer_env_lines,
    apptainer_exec_argv,
    pyxis_srun_options,
)
from hpc_ddp.deploy.flight_recorder import flight_recorder_env
from hpc_ddp.deploy.launchers import LAUNCHERS
from hpc_ddp.deploy.safe_text import comment_text
from hpc_ddp.deploy.spec import SLURM_FIELDS, JobSpec
from hpc_ddp.deploy.templating import get_template
from hpc_ddp.env_vars import REQUEUE_BY_VAR, launch_environ
from hpc_ddp.exit_codes import EXIT_REQUEUE
from hpc_ddp.run_dir.paths import requeue_marker_line, requeue_marker_name

DEFAULT_COMMAND = "hpc-ddp render"
_BLANKS = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class RenderContext:
    """Everything a template sees, already quoted for the shell."""

    spec: JobSpec
    version: str
    command: str
    layout_text: str
    directives: list[str]
    env: list[tuple[str, str]]
    step_command: str
    preflight_command: str
    python_q: str
    port_command: str
    task_exec: str
    container_env_lines: list[str]
    requeue_from_batch: bool
    reads_marker: bool  # the launcher does not pass its workers' exit status on
    requeue_marker: str  # torchrun layout: the marker's path, as shell words; else ""
    requeue_marker_line: str  # what the marker must hold, in double quotes
    exit_requeue: int = EXIT_REQUEUE
    env_requeue_by: str = REQUEUE_BY_VAR


def layout_text(spec: JobSpec) -> str:
    n, g, ppn = spec.nodes, spec.gpus_per_node, spec.ppn
    total = f"{spec.world_text} process{'es' if spec.world_text != '1' else ''}"
    if spec.layout == "torchrun":
        dev = f"{g} GPUs" if g else f"{ppn} CPU processes"
        return f"torchrun, one task per node: {n} nodes x {dev} = {total}"
    if spec.layout == "per-node":
        gpp = spec.gpus_per_process
        if ppn == 1:
            return f"one process per node driving {gpp} GPUs: {n} nodes = {total}"
        return f"{ppn} processes per node, each driving {gpp} GPUs: {n} nodes x {ppn} = {total}"
    if spec.layout == "per-gpu":
        return f"one process per GPU (srun): {n} nodes x {g} GPUs = {total}"
    return f"CPU/Gloo (srun): {n} nodes x {ppn} processes = {total}"


def sbatch_directives(spec: JobSpec) -> list[str]:
    tasks_per_node = LAUNCHERS[spec.launcher].tasks_per_node(spec)
    d = [f"--job-name={spec.name}", f"--nodes={spec.nodes}", f"--ntasks-per-node={tasks_per_node}"]
    cpt = task_cpus(spec)
    if cpt:
        d.append(f"--cpus-per-task={cpt}")
    if spec.gpus_per_node:
        if spec.gpu_binding == "gpus-per-task":
            d.append(f"--gpus-per-task={LAUNCHERS[spec.launcher].gpus_per_task(spec)}")
        else:
            d.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.mem:
        d.append(f"--mem={spec.mem}")
    d.append(f"--time={spec.time}")
    d.extend(plain_directives(spec))
    if spec.signal_lead_s:
        # No "B:": Slurm signals every task of the job's steps, i.e. the training processes.
        d.append(f"--signal={spec.signal}@{spec.signal_lead_s}")
    d.append("--requeue" if spec.requeue else "--no-requeue")
    # A requeued job writes to the same file; without append the first run's log is lost.
    d.append("--open-mode=append")
    d.append(f"--output={log_name(spec, spec.output)}")
    if spec.error:
        d.append(f"--error={log_name(spec, spec.error)}")
    d.extend(spec.extra_sbatch)
    return d


def plain_directives(spec: JobSpec) -> list[str]:
    """The plain options that are set, in the fields' order: --OPTION=VALUE, a switch --OPTION.
    No shell quoting: sbatch parses #SBATCH lines itself, and JobSpec has refused every
    character it would interpret (hpc_ddp.deploy.safe_text)."""
    out = []
    for name, slurm in SLURM_FIELDS.items():
        value = getattr(spec, name)
        if slurm.plain and value:
            out.append(slurm.sbatch if value is True else f"{slurm.sbatch}={value}")
    return out


def log_name(spec: JobSpec, pattern: str) -> str:
    """An array's tasks share the array's job id: ``%j`` becomes ``%A_%a`` (array id, task id),
    so each task appends to its own log and the logs sort by array."""
    return pattern.replace("%j", "%A_%a") if spec.array else pattern


def task_cpus(spec: JobSpec) -> int:
    """CPUs of one Slurm task: a task per node (torchrun) hosts all of its node's processes."""
    return LAUNCHERS[spec.launcher].task_cpus(spec)


def job_env(spec: JobSpec, *, batch_script: bool = False) -> list[tuple[str, str]]:
    """Derived settings first, then the spec's own env (which wins by coming last).
    ``batch_script``: for this module's sbatch script, whose shell may do the requeue."""
    env: dict[str, str] = {}
    # One BLAS/OpenMP thread pool per process sized to its CPUs, not to the whole node.
    env["OMP_NUM_THREADS"] = str(spec.cpus_per_task or 1)
    if spec.layout == "per-node":
        env |= launch_environ(gpus_per_process=spec.gpus_per_process)
    if batch_script and requeue_from_batch(spec):
        # The trainer leaves the requeue to this script's shell (hpc_ddp.runtime.preemption).
        env[REQUEUE_BY_VAR] = LAUNCHERS[spec.launcher].requeue_by
    if spec.gpus_per_node:
        env.update(flight_recorder_env(_given_run_dir(spec)))
    env.update(spec.env)
    return list(env.items())


def requeue_from_batch(spec: JobSpec) -> bool:
    """Whether the batch shell requeues the job after the trainer checkpointed. It runs on the
    host, where scontrol exists even when the step runs in a container without it. srun layouts:
    the step exits 75. torchrun reports its workers' 75 as 1, so there the shell reads the
    trainer's requeue marker in the run dir instead, which takes a program with a hook (the
    trainer) and a run dir known here; else (a program without one, a run dir only in a --config
    file) the program's rank 0
    asks for the requeue, as :func:`hpc_ddp.runtime.preemption.requeue` does without the shell."""
    if not spec.requeue:
        return False
    return not LAUNCHERS[spec.launcher].reads_marker or marker_run_dir(spec) is not None


def marker_run_dir(spec: JobSpec) -> str | None:
    """The program's run dir as the batch shell names it (relative to the job's working dir,
    where the program resolves it too), as its hook reads the arguments: ``--run-dir``, else its
    default unless a ``--config`` file may set it (render reads no files). None when the program
    has no hook."""
    hook = spec.program_hook
    return None if hook is None else hook.shell_run_dir(spec.args)


def _given_run_dir(spec: JobSpec) -> str | None:
    """The program's run dir its arguments give, else its default (None: no hook, or none)."""
    hook = spec.program_hook
    return None if hook is None else hook.flags(spec.args).run_dir or hook.default_run_dir


def requeue_marker(spec: JobSpec) -> tuple[str, str]:
    """(path, line) of the trainer's requeue marker for the torchrun layout's batch shell, as
    shell words: the job id and restart count are the shell's variables, the rest is quoted."""
    reads_marker = LAUNCHERS[spec.launcher].reads_marker
    run_dir = marker_run_dir(spec) if reads_marker and spec.requeue else None
    if run_dir is None:
        return "", ""
    base = shlex.quote(run_dir)
    if spec.array:  # the trainer's run dir is <run dir>_<task id> (array_run_dir)
        base = shlex.quote(run_dir + "_") + '"${SLURM_ARRAY_TASK_ID}"'
    job, restart = "${SLURM_JOB_ID}", "${SLURM_RESTART_COUNT:-0}"
    name = requeue_marker_name(f'"{job}"', f'"{restart}"')
    return f"{base}/{name}", f'"{requeue_marker_line(job, restart)}"'


def _container_srun(spec: JobSpec) -> list[str]:
    """pyxis: srun options that put every task of the step in the image."""
    c = spec.container
    return pyxis_srun_options(c) if c is not None and c.runtime == "pyxis" else []


def _container_exec(spec: JobSpec) -> list[str]:
    """apptainer: the words in front of each process's command."""
    c = spec.container
    if c is None or c.runtime != "apptainer":
        return []
    return apptainer_exec_argv(c, gpus=spec.gpus_per_node > 0)


def _step_exec(spec: JobSpec) -> list[str]:
    """The container's exec words in front of the step's command, unless the launcher's
    template puts them in front of each worker (``_task_exec``)."""
    return [] if LAUNCHERS[spec.launcher].exec_in_template else _container_exec(spec)


def _task_exec(spec: JobSpec) -> str:
    """The container's exec words for the template's workers, as shell words, else ""."""
    return shlex.join(_container_exec(spec)) if LAUNCHERS[spec.launcher].exec_in_template else ""


def _srun_prefix(spec: JobSpec, *, logs: bool = True) -> list[str]:
    """srun and its options, as shell words: quoted, but for the number of nodes of a range,
    which only Slurm knows once the job runs."""
    spec_nodes = f"--nodes={spec.nodes}"
    runtime = '--nodes="${SLURM_JOB_NUM_NODES}"' if spec.nodes_vary else spec_nodes
    options = _srun_options(spec, logs=logs)
    return [runtime if word == spec_nodes else shlex.quote(word) for word in options]


def _srun_options(spec: JobSpec, *, logs: bool) -> list[str]:
    argv = ["srun", "--kill-on-bad-exit=1", f"--wait={spec.exit_wait_s}"]
    tasks_per_node = LAUNCHERS[spec.launcher].tasks_per_node(spec)
    argv += [f"--nodes={spec.nodes}", f"--ntasks-per-node={tasks_per_node}"]
    cpt = task_cpus(spec)
    if cpt:
        # Since Slurm 22.05 srun no longer inherits --cpus-per-task from sbatch.
        argv.append(f"--cpus-per-task={cpt}")
    if spec.resv_ports:
        # A port no other step on these nodes holds, as MASTER_PORT; bare --resv-ports means 0.
        argv.append("--resv-ports=1")
    if spec.per_rank_logs and logs:
        argv += [f"--output={log_name(spec, spec.output)}.rank%t", "--open-mode=append"]
    return argv + _container_srun(spec)


def step_command(spec: JobSpec) -> str:
    launcher = LAUNCHERS[spec.launcher]
    argv = [*_step_exec(spec), *launcher.step_argv(spec)]
    return _wrap([*_srun_prefix(spec), *map(shlex.quote, argv)]) + array_run_dir(spec)


def array_run_dir(spec: JobSpec) -> str:
    """For an array of runs of a program with a hook (the trainer), one more ``--run-dir``
    (the trainer's last one wins): the spec's run dir with ``_<task id>`` appended, expanded by
    the batch shell. Only the task id variable is unquoted; the spec's value stays one word."""
    hook = spec.program_hook
    if not spec.array or hook is None:
        return ""
    run_dir = hook.flags(spec.args).run_dir
    assert run_dir is not None  # JobSpec requires it for an array
    return f' \\\n  --run-dir {shlex.quote(run_dir + "_")}"${{SLURM_ARRAY_TASK_ID}}"'


def preflight_command(spec: JobSpec) -> str:
    """The same task geometry as the training step, running the torch-free preflight."""
    if not spec.preflight:
        return ""
    argv = [*_container_exec(spec), spec.python, "-m", "hpc_ddp.deploy.preflight"]
    return _wrap([*_srun_prefix(spec, logs=False), *map(shlex.quote, argv)])


def container_env_lines(spec: JobSpec) -> list[str]:
    c = spec.container
    return apptainer_env_lines(c) if c is not None and c.runtime == "apptainer" else []


def port_command(spec: JobSpec) -> str:
    """torchrun's rendezvous port, computed where hpc_ddp is installed: in the image if any."""
    argv = [spec.python, "-m", "hpc_ddp.deploy.port"]
    c = spec.container
    if c is not None and c.runtime == "pyxis":  # only a step can enter a pyxis container
        argv = ["srun", "--nodes=1", "--ntasks=1", *pyxis_srun_options(c), *argv]
    else:
        argv = [*_container_exec(spec), *argv]
    return shlex.join(argv)


def _wrap(words: list[str], width: int = 100) -> str:
    """Shell words (quoted already) as one command, broken at word boundaries with ``\\``."""
    lines, cur = [], ""
    for word in words:
        if cur and len(cur) + 1 + len(word) > width - 2:
            lines.append(cur)
            cur = "  " + word
        else:
            cur = f"{cur} {word}" if cur else word
    lines.append(cur)
    return " \\\n".join(lines)


def render(spec: JobSpec, *, command: str = DEFAULT_COMMAND) -> str:
    """The sbatch script for ``spec``. ``command`` is recorded in the header (what produced it)."""
    marker = requeue_marker(spec)
    ctx = RenderContext(
        spec=spec,
        version=__version__,
        command=comment_text(command),  # a comment line, whatever the command held
        layout_text=layout_text(spec),
        directives=sbatch_directives(spec),
        env=job_env(spec, batch_script=True),
        step_command=step_command(spec),
        preflight_command=preflight_command(spec),
        python_q=shlex.quote(spec.python),
        port_command=port_command(spec),
        task_exec=_task_exec(spec),
        container_env_lines=container_env_lines(spec),
        requeue_from_batch=requeue_from_batch(spec),
        reads_marker=LAUNCHERS[spec.launcher].reads_marker,
        requeue_marker=marker[0],
        requeue_marker_line=marker[1],
    )
    template = get_template(LAUNCHERS[spec.launcher].template)
    # Optional sections leave empty lines behind; keep at most one blank line between sections.
    return _BLANKS.sub("\n\n", template.render(r=ctx))
