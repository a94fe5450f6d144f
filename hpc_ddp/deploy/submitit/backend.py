"""``SubmititBackend``: a spec's program (the trainer, or a script or module of yours) through
submitit, on Slurm (``AutoExecutor``, executor "submitit") or on this machine (``LocalExecutor``,
executor "local").

describe: the executor's parameters and the command every task runs (``ProgramTask``, with
what the program's hook adds: the trainer's submitit flags and run dir), checked and written
out without creating anything. submit: the executor (made only then, in ``folder``, a private
directory of this user's: submitit keeps the job's pickles there, and ``pickles`` loads them
only from such a folder) submits the task; a local job is recorded
(``local_jobs.remember_local_jobs``) so that a later cancel can prove it is the toolkit's.
``SubmititJob`` reads the job's state from ``scontrol`` on Slurm, because submitit's own watcher
asks sacct, which clusters without accounting (like the local one) do not answer: a job that
died before writing its result would be waited on forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
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
from hpc_ddp.deploy.submitit import pickles
from hpc_ddp.deploy.submitit.local_jobs import (
    cancellable_by_sigint,
    local_records,
    remember_local_jobs,
)
from hpc_ddp.deploy.submitit.parameters import (
    Kind,
    checked_folder,
    executor_parameters,
    not_used,
)
from hpc_ddp.deploy.submitit.task import FORWARDED_SIGNALS, ProgramTask
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.polling import poll_until
from hpc_ddp.private_paths import ensure_private_dir, replace_file
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.slurm_client import (
    ENDED,
    TERMINAL,
    UNKNOWN,
    LostJobWatch,
    SlurmClient,
    restarts,
    shell_exit_code,
)

# How long a task's result pickle may lag behind the end Slurm reports (a shared file system's
# attribute cache): tasks that COMPLETED or FAILED (raised) wrote one; after other ends (killed,
# cancelled, timed out) there may be none.
RESULT_LAG_S, RESULT_LAG_UNSURE_S = 15.0, 3.0


def result_lag(state: str, info: Mapping[str, str]) -> float:
    """How long to wait for the tasks' result pickles after the job ended ``state``. A job
    FAILED by a signal (exit code over 128, as srun reports a task SIGKILLed by `cancel --now`
    or the OOM killer) did not raise: its task was killed before it could write a result."""
    if state == "COMPLETED" or (state == "FAILED" and shell_exit_code(info) <= 128):
        return RESULT_LAG_S
    return RESULT_LAG_UNSURE_S


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
        folder = self.folder or checked_folder(Path("runs") / "submitit" / spec.name)
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
        task = ProgramTask(list(spec.program), env=dict(job_env(spec)))
        hook = spec.program_hook
        if hook is not None:  # its run dir resolved now: arguments it would refuse fail here
            run_paths = hook.run_paths(spec.args, workdir)
            extra = hook.launcher_requeue_args([sig.name for sig in FORWARDED_SIGNALS])
            task = dataclasses.replace(
                task,
                program=[*task.program, *extra],
                run_dir=None if run_paths is None else str(run_paths.root),
                label=hook.name,
            )
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
            task.run_paths(),
            spec.program_module,
        )

    def submit(self, plan: DryRun) -> SubmititJob:
        request: _Request = plan.request
        ensure_private_dir(request.folder)
        if request.kind == "local":
            local_records()  # refused before the job runs, not after
        # Submission from inside a job must not pass that job's SLURM_* sizing on (SLURM_CONF
        # kept); submitit reads os.environ itself, hence the temporary scrub.
        with scrubbed_environ(self.cluster_env), cancellable_by_sigint():
            if request.kind == "local":
                ex: submitit.Executor = submitit.LocalExecutor(folder=str(request.folder))
            else:
                ex = submitit.AutoExecutor(folder=str(request.folder), cluster="slurm")
            ex.update_parameters(**request.parameters)
            job = ex.submit(request.task)
        if request.kind == "local":
            remember_local_jobs([job], request.folder)
        return SubmititJob(
            job, self.cluster_env, plan.run_paths, self.follow, request.folder, plan.program
        )


class SubmititJob(Job):
    """A submitit job; ``job`` is submitit's own handle (logs, pickles, results)."""

    def __init__(
        self,
        job: submitit.Job[Any],
        cluster_env: Mapping[str, str] | None,
        run_paths: RunPaths | None = None,
        follow: TextIO | None = None,
        folder: Path | None = None,
        program: str | None = None,
    ) -> None:
        self.job = job
        self.folder = folder  # submitit's logs and pickles
        self.program = program
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
        # Pickles of the folder that were not loaded, each with why (pickles.refusal_note).
        self.notes: list[str] = []

    def _info(self) -> dict[str, str]:
        return self._client.job_info(self.job_id) if self._client is not None else {}

    def status(self) -> str:
        if self._finished is not None:
            return self._finished.state
        if self._client is not None:
            return self._info().get("JobState", UNKNOWN)
        if self._local_running():
            return "RUNNING"
        if self._cancelled or self._cancel_marker().exists():
            return "CANCELLED"
        # submitit pickles ("success", value) or ("error", traceback) when the task ends.
        try:
            ok = self.read_pickle(self.job.paths.result_pickle)[0] == "success"
        except FileNotFoundError:
            ok = False
        except pickles.PickleRefusedError:
            return ENDED
        return "COMPLETED" if ok else "FAILED"

    def read_pickle(self, path: Path) -> Any:
        """What submitit pickled at ``path``, loaded only where nobody else could have written
        it (``pickles.load``); a refusal is kept in ``notes`` for the job's report."""
        try:
            return pickles.load(path)
        except pickles.PickleRefusedError as err:
            if (note := pickles.refusal_note(err)) not in self.notes:
                self.notes.append(note)
            raise

    def _local_running(self) -> bool:
        """The controller runs: asked through its Popen, or /proc for a job re-attached from
        another process (hpc_ddp.deploy.job_control.attach_job)."""
        if getattr(self.job, "_process", None) is not None:
            return not self.job.done()
        from hpc_ddp.deploy.submitit.local_jobs import controller_alive

        return controller_alive(self.job_id)

    def _cancel_marker(self) -> Path:
        return Path(self.job.paths.folder) / f"{self.job_id}_cancelled"

    def mark_cancelled(self) -> None:
        """Remember that the job was cancelled: no scheduler does for a local job, so a file
        beside submitit's own says it to later ``status`` calls (hpc_ddp.deploy.job_control)."""
        self._cancelled = True
        replace_file(self._cancel_marker(), b"")  # never through a link planted there

    def wait(self, timeout_s: float | None = None) -> Finished:
        if self._finished is not None:
            return self._finished
        follower = LogFollower(self.output, self.follow)
        lost = LostJobWatch(self.job_id)

        def ended() -> str | None:
            state = self.status()
            if state in TERMINAL:
                return state
            follower.poll()
            lost.answer(state)
            return None

        state = poll_until(ended, timeout_s, interval_s=0.2)
        if state is None:
            self.cancel()
            raise HpcDdpError(
                f"submitit job {self.job_id} not done after {timeout_s:.0f} s: cancelled it",
                hint="raise submit --wait-timeout, or look at the job's logs in its folder",
            )
        follower.poll(final=True)
        info = self._info()
        outcomes = self._outcomes(result_lag(state, info))
        count = restarts(info)
        failed = [(k, o[1]) for k, o in enumerate(outcomes) if o is not None and o[0] != "success"]
        missing = [str(k) for k, o in enumerate(outcomes) if o is None]
        if failed:  # ("error", the task's traceback): the most a user can learn
            task, trace = failed[0]
            error = f"task {task} failed:\n{trace}"
            done = Finished(self.job_id, state, 1, count, self.output, error=error)
        elif missing:
            error = (
                f"the job ended {state} without a result from task{'s' * (len(missing) > 1)} "
                f"{', '.join(missing)}: killed before it could write one (cancel --now, out of "
                "memory, a node failure)"
            )
            done = Finished(self.job_id, state, 1, count, self.output, error=error)
        else:
            result = outcomes[0][1] if outcomes[0] is not None else None
            summary = result if isinstance(result, dict) else {}
            code = int(summary.get("exit_code", 0))
            trained = summary if self.run_paths is not None else None  # it has a run dir
            done = Finished(self.job_id, state, code, count, self.output, trained or None)
        self._finished = done
        return done

    def _outcomes(self, lag_s: float) -> list[tuple[str, Any] | None]:
        """What submitit pickled for each task, in task order: ("success", value) or ("error",
        traceback); None for a task that never wrote it. Read here, not through
        ``Job.results()``, which waits for a pickle that a killed task never writes until sacct
        (absent on the embedded cluster) says the job ended: for ever."""
        folder = Path(self.job.paths.folder)
        paths = [self.job.task(k).paths.result_pickle for k in range(self.job.num_tasks)]

        def all_written() -> bool:
            with contextlib.suppress(OSError):  # NFS: refresh the folder's cached view, as
                folder.chmod(folder.stat().st_mode)  # submitit does before it looks
            return all(os.path.lexists(p) for p in paths)

        poll_until(all_written, lag_s, interval_s=0.2)  # a file system may show them after the end
        return [self._outcome(p) for p in paths]

    def _outcome(self, path: Path) -> tuple[str, Any] | None:
        try:
            return self.read_pickle(path)  # type: ignore[no-any-return]
        except FileNotFoundError:
            return None
        except pickles.PickleRefusedError as err:
            return ("error", pickles.refusal_note(err))

    def cancel(self) -> None:
        if self._finished is not None:
            return
        self._cancelled = True
        if self._client is not None:
            self._client.cancel(self.job_id)
        else:
            self.job.cancel(check=False)
