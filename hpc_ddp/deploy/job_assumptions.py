"""What a rendered job will run and what it takes for granted on the compute nodes.

A batch script names an interpreter (``python`` from PATH unless the spec says otherwise), runs
a program with it (the trainer, with its data and run dirs) and relies on ``setup`` lines for
everything else. ``render`` prints this summary (``summary_lines``) so that a job that could
not run is seen before it is queued; ``hpc-ddp doctor --job`` checks it where the job will run,
inside an allocation (``job_checks``). Torch-free: the trainer's arguments are read with its
own parser (hpc_ddp.train.config), never by importing the trainer.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.deploy.core import TRAIN_MODULE
from hpc_ddp.deploy.doctor import FAIL, OK, WARN, Check
from hpc_ddp.deploy.sbatch.submit import script_workdir
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.deploy.trainer_args import trainer_args_in_script, trainer_flags
from hpc_ddp.train import config

IMPORT_TIMEOUT_S = 120.0  # a cold import of torch on a network file system takes a while


@dataclass(frozen=True)
class JobAssumptions:
    """The facts of a job that the compute nodes must make true."""

    python: str  # the interpreter as the job names it (a bare name is looked up on PATH)
    program: tuple[str, ...]  # what follows it
    launcher: str = "srun"
    has_setup: bool = False  # setup lines (module load, venv activation) run first
    workdir: str = ""  # "" = the submission directory
    trainer: config.TrainConfig | None = None  # the trainer's settings, if it runs the trainer

    @property
    def runs_trainer(self) -> bool:
        return self.trainer is not None


def of_spec(spec: JobSpec) -> JobAssumptions:
    return JobAssumptions(
        spec.python,
        tuple(spec.program),
        spec.launcher,
        bool(spec.setup),
        spec.workdir,
        _trainer_config(spec.args) if spec.runs_trainer else None,
    )


def of_script(text: str) -> JobAssumptions | None:
    """The same facts from a rendered script (the line that starts the trainer), or None."""
    args = trainer_args_in_script(text)
    if args is None:
        return None
    python, launcher = "python", "srun"
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if TRAIN_MODULE in words and words.index(TRAIN_MODULE) > 1:
            before = [w for w in words[: words.index(TRAIN_MODULE) - 1] if w != "-u"]
            python = before[-1] if before else python
            launcher = "torchrun" if python == "torchrun" else "srun"
            break
    if launcher == "torchrun":
        python = "python"  # torchrun's own; the check reads it from torchrun itself
    workdir = str(script_workdir(text, Path(".")))  # its #SBATCH --chdir, if it has one
    program = ("-m", TRAIN_MODULE, *args)
    return JobAssumptions(python, program, launcher, workdir=workdir, trainer=_trainer_config(args))


def _trainer_config(args: list[str]) -> config.TrainConfig:
    return config.from_args(trainer_flags(args))


def _where(path: str, workdir: str) -> str:
    if Path(path).is_absolute():
        return path
    base = workdir or "the submission directory"
    return f"{path} (relative to {base})"


def summary_lines(a: JobAssumptions) -> list[str]:
    """What the job will run and assume, for people (render prints it to stderr)."""
    after = "after the spec's setup lines" if a.has_setup else "no setup lines given"
    if a.launcher == "torchrun":
        lines = [f"the job runs on every node: torchrun ... {shlex.join(a.program)}"]
        lines.append(f"  interpreter: torchrun's own, from the compute nodes' PATH ({after})")
    else:
        lines = [f"the job runs (srun starts every process): {shlex.join([a.python, *a.program])}"]
    if a.launcher == "torchrun":
        pass  # said above
    elif "/" in a.python:
        lines.append(f"  interpreter: {a.python}, which must exist on every compute node")
    else:
        lines.append(f"  interpreter: `{a.python}` from the compute nodes' PATH ({after})")
    if a.runs_trainer:
        lines.append("  assumes: hpc_ddp and torch import with that interpreter")
        t = a.trainer
        assert t is not None
        lines.append(f"  run dir: {_where(t.run_dir, a.workdir)}")
        if t.synthetic:
            lines.append(f"  data: synthetic {t.dataset} (no files read)")
        elif t.download:
            lines.append(
                f"  data: {t.dataset} in {_where(t.data_dir, a.workdir)}, downloaded there if "
                "missing (the nodes need internet access, or download it first)"
            )
        else:
            lines.append(f"  data: {t.dataset} in {_where(t.data_dir, a.workdir)} (must exist)")
    lines.append("  check it inside an allocation: srun -N1 hpc-ddp doctor --job THIS_FILE")
    return lines


def job_checks(a: JobAssumptions, workdir: Path, *, torch: bool = True) -> list[Check]:
    """Doctor's checks of the job's assumptions, here (run it on a compute node)."""
    checks = [check_interpreter(a, torch=torch)]
    if a.trainer is not None:
        checks.append(check_data_dir(a.trainer, workdir))
    return checks


def _torchrun_python() -> str | None:
    """The interpreter torchrun runs its workers with: the one in its #! line."""
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        return None
    try:
        first = Path(torchrun).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[2:].split()[0] if first.startswith("#!") and first[2:].split() else None


def check_interpreter(a: JobAssumptions, *, torch: bool = True) -> Check:
    if a.launcher == "torchrun":
        found = _torchrun_python()
        if found is None:
            return Check(
                FAIL, "job interpreter", "torchrun is not found here (or has no #! line)",
                "run the job's setup lines first, or install torch into the job's environment",
            )  # fmt: skip
    else:
        found = shutil.which(a.python)
    if found is None:
        return Check(
            FAIL,
            "job interpreter",
            f"{a.python!r} is not found here (PATH, or no such executable)",
            "run the job's setup lines first (module load, source venv/bin/activate) or set "
            "the spec's python to an absolute path that exists on every node",
        )
    if not a.runs_trainer:
        return Check(OK, "job interpreter", found)
    modules = "hpc_ddp, torch" if torch else "hpc_ddp"
    try:
        proc = subprocess.run(
            [found, "-c", f"import {modules}"],
            capture_output=True,
            text=True,
            timeout=IMPORT_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return Check(FAIL, "job interpreter", f"{found}: `import {modules}` took too long")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no error output"])[-1]
        return Check(
            FAIL,
            "job interpreter",
            f"{found} cannot `import {modules}`: {last}",
            "install hpc-ddp (with torch) into that interpreter's environment, or point the "
            "spec's python / setup lines at the one that has it",
        )
    return Check(OK, "job interpreter", f"{found} imports {modules}")


def check_data_dir(t: config.TrainConfig, workdir: Path) -> Check:
    path = workdir / t.data_dir
    if t.synthetic:
        return Check(OK, "data dir", f"synthetic {t.dataset}: no files needed")
    if path.is_dir() and any(path.iterdir()):
        return Check(OK, "data dir", f"{path} exists")
    if not t.download:
        return Check(
            FAIL, "data dir", f"{path} is missing or empty and --no-download is set",
            "put the dataset there first, or let the trainer download it",
        )  # fmt: skip
    parent = path if path.is_dir() else path.parent
    if not os.access(parent, os.W_OK):
        return Check(FAIL, "data dir", f"{path} is missing and {parent} is not writable")
    return Check(
        WARN,
        "data dir",
        f"{path} is empty: the trainer will download {t.dataset} there",
        "compute nodes often have no internet access: download it on the login node first",
    )
