"""``SubmititBackend``: a spec's program (the trainer, or a script or module of yours) through
submitit, on Slurm (``AutoExecutor``, executor "submitit") or on this machine (``LocalExecutor``,
executor "local").

describe: the executor's parameters and the command every task runs (``ProgramTask``; the
trainer's is a ``TrainTask``), checked and written out without creating anything. submit: the
executor (made only then, in ``folder``) submits the task. ``SubmititJob`` reads the job's state
from ``scontrol`` on Slurm, because submitit's own watcher asks sacct, which clusters without
accounting (like the local one) do not answer: a job that died before writing its result would
be waited on forever.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import submitit

from hpc_ddp.deploy.backend import Backend, DryRun, Finished, Job
from hpc_ddp.deploy.sbatch.render import job_env
from hpc_ddp.deploy.sbatch.submit import LogFollower
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.deploy.submission_env import scrubbed_environ, submission_env, with_this_python
from hpc_ddp.deploy.submitit.local_control import cancellable_by_sigint
from hpc_ddp.deploy.submitit.parameters import (
    Kind,
    checked_folder,
    executor_parameters,
    not_used,
)
from hpc_ddp.deploy.submitit.task import ProgramTask, TrainTask
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.runtime.run_paths import RunPaths
from hpc_ddp.slurm_client import TERMINAL, LostJobWatch, SlurmClient, restarts, wait_for

# How long a task's result pickle may lag behind the end Slurm reports (a shared file system's
# attribute cache): a job that COMPLETED wrote one; after any other end there may be none.
RESULT_LAG_S, RESULT_LAG_UNSURE_S = 15.0, 3.0


@dataclass(frozen=True)
class _Request:
    kind: Kind
    folder: Path
    parameters: dict[str, Any]
    task: ProgramTask


class SubmititBackend(Backend):
    """submitit on Slurm (``kind="submitit"``) or on this machine (``kind="local"``)."""

    def __init__(
        self,
        kind: Kind = "submitit",
        *,
        folder: str | Path | None = None,
        cluster_env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        follow: TextIO | None = None,
    ) -> None:
        if kind not in ("submitit", "local"):
            raise ConfigError(f"submitit executor {kind!r} is not one of submitit, local")
        self.kind: Kind = kind
        # None: runs/submitit/NAME, from the spec's validated name
        self.folder = checked_folder(folder) if folder is not None else None
        # The local executor talks to no Slurm; on Slurm, jobs run this interpreter's python.
        self.cluster_env = None if kind == "local" else with_this_python(cluster_env or {})
        self.cwd = Path(cwd) if cwd is not None else None
        self.follow = follow

    @property
    def executor(self) -> str:  # type: ignore[override]  # per instance: submitit or local
        return self.kind

    def describe(self, spec: JobSpec) -> DryRun:
        parameters = executor_parameters(spec, self.kind)
        folder = self.folder or Path("runs") / "submitit" / spec.name
        cwd = (self.cwd or Path.cwd()).absolute()
        # Where the tasks run: submitit's jobs start in the submitter's directory (--chdir on
        # Slurm); submitit needs a file system shared with the job, so the script is checked here.
        workdir = cwd if self.kind == "local" else cwd / spec.workdir
        if spec.script and not (workdir / spec.script).is_file():
            raise ConfigError(
                f"script {spec.script!r}: no such file in {workdir}, where the tasks start",
                hint="give the script's path relative to that directory, or an absolute one",
            )
        # Same environment as the sbatch templates give (OMP_NUM_THREADS, GPUs per process...).
        task_class = TrainTask if spec.runs_trainer else ProgramTask
        task = task_class(list(spec.program), env=dict(job_env(spec)))
        where = "LocalExecutor, this machine" if self.kind == "local" else "AutoExecutor, Slurm"
        text = "\n".join(
            [
                f"# submitit ({where}); logs and pickles in {folder}",
                "# executor parameters: "
                + " ".join(f"{k}={v}" for k, v in sorted(parameters.items())),
                "# every task runs, with "
                + " ".join(f"{k}={shlex.quote(v)}" for k, v in task.env.items())
                + " and its RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK:",
                shlex.join(task.command()),
                *(f"# not used: {note}" for note in not_used(spec, self.kind)),
                "",
            ]
        )  # fmt: skip
        return DryRun(
            self.kind,
            text,
            f"submitit {self.kind} job in {folder}",
            _Request(self.kind, folder, parameters, task),
            task.run_paths(workdir),
        )

    def submit(self, plan: DryRun) -> SubmititJob:
        request: _Request = plan.request
        request.folder.mkdir(parents=True, exist_ok=True)
        # Submission from inside a job must not pass that job's SLURM_* sizing on (SLURM_CONF
        # kept); submitit reads os.environ itself, hence the temporary scrub.
        with scrubbed_environ(self.cluster_env), cancellable_by_sigint():
            if request.kind == "local":
                ex: submitit.Executor = submitit.LocalExecutor(folder=str(request.folder))
            else:
                ex = submitit.AutoExecutor(folder=str(request.folder), cluster="slurm")
            ex.update_parameters(**request.parameters)
            job = ex.submit(request.task)
        return SubmititJob(job, self.cluster_env, plan.run_paths, self.follow, request.folder)


class SubmititJob(Job):
    """A submitit job; ``job`` is submitit's own handle (logs, pickles, results)."""

    def __init__(
        self,
        job: submitit.Job[Any],
        cluster_env: Mapping[str, str] | None,
        run_paths: RunPaths | None = None,
        follow: TextIO | None = None,
        folder: Path | None = None,
    ) -> None:
        self.job = job
        self.folder = folder  # submitit's logs and pickles
        self.job_id = str(job.job_id)
        self.executor = "local" if cluster_env is None else "submitit"
        self.cluster_env = None if cluster_env is None else dict(cluster_env)
        self.output = Path(job.paths.stdout)  # rank 0's log
        self.run_paths = run_paths
        self.follow = follow
        self._client = None if cluster_env is None else SlurmClient(
            {**submission_env(), **cluster_env}
        )  # fmt: skip
        self._finished: Finished | None = None
        self._cancelled = False  # the local executor has no scheduler to remember it

    def _info(self) -> dict[str, str]:
        return self._client.job_info(self.job_id) if self._client is not None else {}

    def status(self) -> str:
        if self._finished is not None:
            return self._finished.state
        if self._client is not None:
            return self._info().get("JobState", "UNKNOWN")
        if self._local_running():
            return "RUNNING"
        if self._cancelled or self._cancel_marker().exists():
            return "CANCELLED"
        # submitit pickles ("success", value) or ("error", traceback) when the task ends.
        pickle = self.job.paths.result_pickle
        ok = pickle.exists() and submitit.core.utils.pickle_load(pickle)[0] == "success"
        return "COMPLETED" if ok else "FAILED"

    def _local_running(self) -> bool:
        """The controller runs: asked through its Popen, or /proc for a job re-attached from
        another process (hpc_ddp.deploy.control.attach)."""
        if getattr(self.job, "_process", None) is not None:
            return not self.job.done()
        from hpc_ddp.deploy.submitit.local_control import controller_alive

        return controller_alive(self.job_id)

    def _cancel_marker(self) -> Path:
        return Path(self.job.paths.folder) / f"{self.job_id}_cancelled"

    def mark_cancelled(self) -> None:
        """Remember that the job was cancelled: no scheduler does for a local job, so a file
        beside submitit's own says it to later ``status`` calls (hpc_ddp.deploy.control)."""
        self._cancelled = True
        self._cancel_marker().touch()

    def wait(self, timeout_s: float | None = None) -> Finished:
        if self._finished is not None:
            return self._finished
        follower = LogFollower(self.output, self.follow)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        lost = LostJobWatch(self.job_id)
        while (state := self.status()) not in TERMINAL:
            follower.poll()
            lost.answer(state != "UNKNOWN")
            if deadline is not None and time.monotonic() > deadline:
                self.cancel()
                raise HpcDdpError(
                    f"submitit job {self.job_id} not done after {timeout_s:.0f} s: cancelled it",
                    hint="raise submit --wait-timeout, or look at the job's logs in its folder",
                )
            time.sleep(0.2)
        follower.poll()
        count = restarts(self._info())
        outcome = self._rank0_outcome(RESULT_LAG_S if state == "COMPLETED" else RESULT_LAG_UNSURE_S)
        if outcome is None:
            error = (
                f"the job ended {state} without a result from its task 0: killed before it "
                "could write one (cancel --now, out of memory, a node failure)"
            )
            done = Finished(self.job_id, state, 1, count, self.output, error=error)
        elif outcome[0] != "success":  # ("error", the task's traceback)
            done = Finished(self.job_id, state, 1, count, self.output, error=str(outcome[1]))
        else:
            summary = outcome[1] if isinstance(outcome[1], dict) else {}
            code = int(summary.get("exit_code", 0))
            trained = summary if self.run_paths is not None else None  # a trainer's job
            done = Finished(self.job_id, state, code, count, self.output, trained or None)
        self._finished = done
        return done

    def _rank0_outcome(self, grace_s: float) -> tuple[str, Any] | None:
        """What submitit pickled for task 0 (a trainer's carries its result.json): ("success",
        value) or ("error", traceback); None when the task never wrote it. Read here, not
        through ``Job.results()``, which waits for a pickle that a killed task never writes
        until sacct (absent on the embedded cluster) says the job ended: for ever."""
        pickle = self.job.task(0).paths.result_pickle
        try:  # a shared file system may show the file a moment after Slurm reports the end
            wait_for(pickle.exists, grace_s, what=str(pickle), interval_s=0.2)
        except TimeoutError:
            return None
        return submitit.core.utils.pickle_load(pickle)

    def cancel(self) -> None:
        if self._finished is not None:
            return
        self._cancelled = True
        if self._client is not None:
            self._client.cancel(self.job_id)
        else:
            self.job.cancel(check=False)
