"""``hpc-ddp doctor --job FILE``: are a job's assumptions (hpc_ddp.deploy.job_assumptions)
true here? Run it where the job runs, inside an allocation, after the job's setup lines."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from hpc_ddp.deploy.job_assumptions import JobAssumptions, of_script, of_spec
from hpc_ddp.deploy.launchers import LAUNCHERS
from hpc_ddp.deploy.spec import build_spec
from hpc_ddp.errors import ConfigError
from hpc_ddp.schema import read_text_file

from .node import FAIL, OK, Check

IMPORT_TIMEOUT_S = 120.0  # a cold import of torch on a network file system takes a while


def job_assumptions(path: Path) -> JobAssumptions:
    """What the job in ``path`` (a spec or a rendered script) assumes of the node."""
    if path.suffix in (".toml", ".json"):
        return of_spec(build_spec(path))
    found = of_script(read_text_file(path, what="batch script"))
    if found is None:
        raise ConfigError(
            f"{path} does not run the hpc_ddp trainer (or another program with a hook): "
            "nothing to check for --job",
            hint="give a script rendered by hpc-ddp render, or its spec file",
        )
    return found


def job_checks(a: JobAssumptions, workdir: Path, *, torch: bool = True) -> list[Check]:
    """Doctor's checks of the job's assumptions, here (run it on a compute node)."""
    checks = [check_interpreter(a, torch=torch)]
    if a.needs is not None:
        checks += a.needs.checks(workdir)
    return checks


def _launcher_python(program: str) -> str | None:
    """The interpreter a launcher's program (torchrun) runs its workers with: the one in its
    #! line."""
    found = shutil.which(program)
    if found is None:
        return None
    try:
        first = Path(found).read_text(errors="replace").splitlines()[0]
    except (OSError, IndexError):
        return None
    return first[2:].split()[0] if first.startswith("#!") and first[2:].split() else None


def check_interpreter(a: JobAssumptions, *, torch: bool = True) -> Check:
    own = LAUNCHERS[a.launcher].runs_python
    if own is not None:
        found = _launcher_python(own)
        if found is None:
            return Check(
                FAIL, "job interpreter", f"{own} is not found here (or has no #! line)",
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
    needed = [m for m in (a.needs.imports if a.needs else ()) if torch or m != "torch"]
    if not needed:
        return Check(OK, "job interpreter", found)
    modules = ", ".join(needed)
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
