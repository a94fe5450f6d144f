"""What a rendered job will run and what it takes for granted on the compute nodes.

A batch script names an interpreter (``python`` from PATH unless the spec says otherwise), runs
a program with it (the trainer, with its data and run dirs) and relies on ``setup`` lines for
everything else. ``render`` prints this summary (``summary_lines``) so that a job that could
not run is seen before it is queued; ``hpc-ddp doctor --job`` checks it where the job will run,
inside an allocation (hpc_ddp/doctor_checks/job.py). What the program itself needs (the trainer:
hpc_ddp and torch, its run and data dirs) its hook says (``ProgramHook.job_needs``,
hpc_ddp.deploy.program), reading the arguments with the program's own parser. Torch-free.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.deploy.launchers import DEFAULT_LAUNCHER, LAUNCHERS, launcher_running
from hpc_ddp.deploy.program import JobNeeds, program_in_script
from hpc_ddp.deploy.sbatch.submit import script_workdir
from hpc_ddp.deploy.spec import JobSpec


@dataclass(frozen=True)
class JobAssumptions:
    """The facts of a job that the compute nodes must make true."""

    python: str  # the interpreter as the job names it (a bare name is looked up on PATH)
    program: tuple[str, ...]  # what follows it
    launcher: str = DEFAULT_LAUNCHER
    has_setup: bool = False  # setup lines (module load, venv activation) run first
    workdir: str = ""  # "" = the submission directory
    needs: JobNeeds | None = None  # what its program's hook says it needs, if it has a hook


def of_spec(spec: JobSpec) -> JobAssumptions:
    hook = spec.program_hook
    return JobAssumptions(
        spec.python,
        tuple(spec.program),
        spec.launcher,
        bool(spec.setup),
        spec.workdir,
        hook.job_needs(spec.args) if hook is not None else None,
    )


def of_script(text: str) -> JobAssumptions | None:
    """The same facts from a rendered script (the line that starts a program with a hook, the
    trainer), or None."""
    found = program_in_script(text)
    if found is None:
        return None
    python, launcher = "python", DEFAULT_LAUNCHER
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if found.module in words and words.index(found.module) > 1:
            before = [w for w in words[: words.index(found.module) - 1] if w != "-u"]
            python = before[-1] if before else python
            launcher = launcher_running(python)
            break
    if LAUNCHERS[launcher].runs_python is not None:
        python = "python"  # the launcher's own; the check reads it from the launcher itself
    workdir = str(script_workdir(text, Path(".")))  # its #SBATCH --chdir, if it has one
    program = ("-m", found.module, *found.args)
    needs = found.hook.job_needs(found.args)
    return JobAssumptions(python, program, launcher, workdir=workdir, needs=needs)


def _where(path: str, workdir: str) -> str:
    if Path(path).is_absolute():
        return path
    base = workdir or "the submission directory"
    return f"{path} (relative to {base})"


def summary_lines(a: JobAssumptions) -> list[str]:
    """What the job will run and assume, for people (render prints it to stderr)."""
    after = "after the spec's setup lines" if a.has_setup else "no setup lines given"
    own = LAUNCHERS[a.launcher].runs_python
    if own is not None:
        lines = [f"the job runs on every node: {own} ... {shlex.join(a.program)}"]
        lines.append(f"  interpreter: {own}'s own, from the compute nodes' PATH ({after})")
    else:
        lines = [f"the job runs (srun starts every process): {shlex.join([a.python, *a.program])}"]
        if "/" in a.python:
            lines.append(f"  interpreter: {a.python}, which must exist on every compute node")
        else:
            lines.append(f"  interpreter: `{a.python}` from the compute nodes' PATH ({after})")
    if a.needs is not None:
        if a.needs.imports:
            lines.append(f"  assumes: {' and '.join(a.needs.imports)} import with that interpreter")
        if a.needs.run_dir is not None:
            lines.append(f"  run dir: {_where(a.needs.run_dir, a.workdir)}")
        lines += a.needs.summary_lines(lambda path: _where(path, a.workdir))
    lines.append("  check it inside an allocation: srun -N1 hpc-ddp doctor --job THIS_FILE")
    return lines
