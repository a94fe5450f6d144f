"""``SbatchBackend``: a JobSpec (or an already rendered script) through real sbatch.

describe: the batch script (``render``), with the run dir whose result.json the job reports:
what the program's hook says (the trainer's), or the ``--run-dir`` a spec gives a program of
the user's without one. submit: sbatch from the submission directory, with an environment
scrubbed of any enclosing job and this interpreter's bin directory first on PATH (the scripts
run ``python``).
The ``SlurmJob`` handle reads ``scontrol show job``, so it needs no accounting (no sacct).
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from hpc_ddp.deploy.backend import Backend, DryRun, Finished, Job, read_result
from hpc_ddp.deploy.program import program_in_script, program_run_dir
from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.sbatch.submit import sbatch, script_workdir, wait_job
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.deploy.submission_env import submission_env, with_this_python
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.schema import read_text_file
from hpc_ddp.slurm_client import SlurmClient

DEFAULT_PRODUCER = "hpc_ddp.submit"
# An #SBATCH line asking for a job array (long or short form).
_ARRAY_DIRECTIVE = re.compile(r"^#SBATCH[ \t]+(--array|-a)\b", re.MULTILINE)


@dataclass(frozen=True)
class _Script:
    """What ``submit`` hands to sbatch: the text, and the file it came from (None: rendered)."""

    text: str
    path: Path | None
    name: str


class SbatchBackend(Backend):
    """sbatch on the Slurm that ``cluster_env`` names (None: the one this environment uses)."""

    executor = "sbatch"

    def __init__(
        self,
        *,
        cluster_env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        follow: TextIO | None = None,
        produced_by: str = DEFAULT_PRODUCER,
    ) -> None:
        self.cluster_env = with_this_python(cluster_env or {})
        self.cwd = Path(cwd) if cwd is not None else None
        self.follow = follow  # where wait() copies the job's log as it grows
        self.produced_by = produced_by  # recorded in the rendered script's header

    def _cwd(self) -> Path:
        return (self.cwd or Path.cwd()).absolute()

    def describe(self, spec: JobSpec | str | Path) -> DryRun:
        """The batch script of a JobSpec, or the text of a rendered script file."""
        if isinstance(spec, JobSpec):
            script = _Script(render(spec, command=self.produced_by), None, f"{spec.name}.sbatch")
            workdir = self._cwd() / spec.workdir
            module, hook, args = spec.program_module, spec.program_hook, spec.args
        else:
            path = Path(spec)
            script = _Script(read_text_file(path, what="batch script"), path, path.name)
            workdir = script_workdir(script.text, self._cwd())
            found = program_in_script(script.text)
            module, hook, args = found if found is not None else (None, None, [])
        if hook is not None:  # resolved now: arguments it would refuse fail before the queue
            run_paths = hook.run_paths(args, workdir)
        elif isinstance(spec, JobSpec) and (own := program_run_dir(spec.args)) is not None:
            run_paths = RunPaths(workdir / own)  # a program of the user's, told its run dir
        else:
            run_paths = None
        if _ARRAY_DIRECTIVE.search(script.text):
            run_paths = None  # one run dir per task: <run dir>_<task id>
        return DryRun(
            "sbatch",
            script.text,
            shlex.join(["sbatch", str(script.path or script.name)]),
            script,
            run_paths,
            module,
        )

    def submit(self, plan: DryRun) -> SlurmJob:
        script: _Script = plan.request
        if _ARRAY_DIRECTIVE.search(script.text):
            raise ConfigError(
                "hpc_ddp.submit follows one job; an array's tasks are separate jobs",
                hint="render the spec (hpc-ddp render --script-out job.sbatch) and run "
                "`sbatch job.sbatch`; task N trains into <run dir>_N and logs to %x-%A_N.out",
            )
        path = script.path
        if path is None:  # sbatch copies the script at submission: a temporary file will do
            fd, tmp = tempfile.mkstemp(prefix=f"{Path(script.name).stem}-", suffix=".sbatch")
            with os.fdopen(fd, "w") as f:
                f.write(script.text)
            path = Path(tmp)
        try:
            sub = sbatch(path, self.cluster_env, cwd=self._cwd())
        finally:
            if script.path is None:
                path.unlink(missing_ok=True)
        return SlurmJob(
            sub.job_id, self.cluster_env, sub.output, plan.run_paths, self.follow, plan.program
        )


class SlurmJob(Job):
    """A job in Slurm, asked about through ``scontrol`` (hpc_ddp.slurm_client)."""

    executor = "sbatch"

    def __init__(
        self,
        job_id: str,
        cluster_env: Mapping[str, str],
        output: Path | None,
        run_paths: RunPaths | None = None,
        follow: TextIO | None = None,
        program: str | None = None,
    ) -> None:
        self.job_id = job_id
        self.cluster_env = dict(cluster_env)
        self.output = output
        self.run_paths = run_paths
        self.follow = follow
        self.program = program
        self._finished: Finished | None = None

    def _client(self) -> SlurmClient:
        return SlurmClient({**submission_env(), **self.cluster_env})

    def status(self) -> str:
        if self._finished is not None:
            return self._finished.state
        return self._client().job_state(self.job_id)

    def wait(self, timeout_s: float | None = None) -> Finished:
        if self._finished is None:
            done = wait_job(
                self.job_id,
                self.cluster_env,
                timeout_s=timeout_s,
                output=self.output,
                follow=self.follow,
            )
            self._finished = Finished(
                done.job_id,
                done.state,
                done.exit_code,
                done.restarts,
                done.output,
                read_result(self.run_paths),
            )
        return self._finished

    def cancel(self) -> None:
        if self._finished is None:
            self._client().cancel(self.job_id)
