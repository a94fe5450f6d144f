"""``SubmititBackend``: the trainer through submitit, on Slurm (``AutoExecutor``, executor
"submitit") or on this machine (``LocalExecutor``, executor "local").

describe: the executor's parameters and the command every task runs (``TrainTask``), checked
and written out without creating anything. submit: the executor (made only then, in ``folder``)
submits the task. ``SubmititJob`` reads the job's state from ``scontrol`` on Slurm, because
submitit's own watcher asks sacct, which clusters without accounting (like the local one) do not
answer: a job that died before writing its result would be waited on forever.
"""

from __future__ import annotations

import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TextIO

import submitit

from hpc_ddp.deploy.backend import Backend, DryRun, Finished, Job
from hpc_ddp.deploy.sbatch.render import job_env
from hpc_ddp.deploy.sbatch.submit import LogFollower
from hpc_ddp.deploy.spec import JobSpec, time_limit_seconds
from hpc_ddp.deploy.submission_env import scrubbed_environ, submission_env, with_this_python
from hpc_ddp.deploy.submitit.task import TrainTask
from hpc_ddp.deploy.trainer_args import trainer_run_paths
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.runtime.run_paths import RunPaths
from hpc_ddp.slurm_client import TERMINAL, SlurmClient, restarts

Kind = Literal["submitit", "local"]


@dataclass(frozen=True)
class _Request:
    kind: Kind
    folder: Path
    parameters: dict[str, Any]
    task: TrainTask


def executor_parameters(spec: JobSpec, kind: Kind) -> dict[str, Any]:
    """submitit's ``update_parameters`` for ``spec``; ConfigError for what submitit cannot run."""
    if spec.container is not None:
        raise ConfigError(
            "submitit runs the trainer with this Python, not in a container image",
            hint="submit a spec with a [container] table with the sbatch executor "
            "(`hpc-ddp submit --executor sbatch`)",
        )
    if spec.launcher != "srun":
        raise ConfigError(
            "submitit starts one task per process itself: launcher must be srun",
            hint="drop launcher = 'torchrun' from the spec for --executor submitit/local",
        )
    minutes = max(1, _minutes(spec.time))
    if kind == "local":
        if spec.nodes != 1:
            raise ConfigError(
                f"the local executor runs on one machine; the spec asks for {spec.nodes} nodes",
                hint="set nodes = 1 (and procs_per_node) or use --executor submitit",
            )
        return dict(
            timeout_min=minutes, tasks_per_node=spec.ppn, signal_delay_s=spec.signal_lead_s or 30
        )
    params: dict[str, Any] = dict(
        timeout_min=minutes, tasks_per_node=spec.ppn, nodes=spec.nodes, name=spec.name
    )
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    if spec.partition:
        params["slurm_partition"] = spec.partition
    params["slurm_signal_delay_s"] = spec.signal_lead_s or 90
    if spec.account:
        params["slurm_account"] = spec.account
    return params


def _minutes(limit: str) -> int:
    secs = time_limit_seconds(limit)
    return 60 * 24 * 365 if secs is None else (secs + 59) // 60


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
        self.folder = Path(folder) if folder is not None else None  # default: runs/submitit/NAME
        # The local executor talks to no Slurm; on Slurm, jobs run this interpreter's python.
        self.cluster_env = None if kind == "local" else with_this_python(cluster_env or {})
        self.cwd = Path(cwd) if cwd is not None else None
        self.follow = follow

    @property
    def executor(self) -> str:  # type: ignore[override]  # per instance: submitit or local
        return self.kind

    def describe(self, spec: JobSpec) -> DryRun:
        if not spec.runs_trainer:
            raise ConfigError(
                "the submitit backend runs the hpc_ddp trainer (module hpc_ddp.train)",
                hint="use --executor sbatch for another program",
            )
        parameters = executor_parameters(spec, self.kind)
        folder = self.folder or Path("runs") / "submitit" / spec.name
        cwd = (self.cwd or Path.cwd()).absolute()
        # Same environment as the sbatch templates give (OMP_NUM_THREADS, HPC_DDP_GPUS_PER_...).
        task = TrainTask(list(spec.args), env=dict(job_env(spec)))
        where = "LocalExecutor, this machine" if self.kind == "local" else "AutoExecutor, Slurm"
        text = "\n".join(
            [
                f"# submitit ({where}); logs and pickles in {folder}",
                "# executor parameters: "
                + " ".join(f"{k}={v}" for k, v in sorted(parameters.items())),
                "# every task runs, with "
                + " ".join(f"{k}={shlex.quote(v)}" for k, v in task.env.items()) + ":",
                shlex.join(task.trainer_argv()),
                "",
            ]
        )  # fmt: skip
        return DryRun(
            self.kind,
            text,
            f"submitit {self.kind} job in {folder}",
            _Request(self.kind, folder, parameters, task),
            trainer_run_paths(spec.args, cwd),
        )

    def submit(self, plan: DryRun) -> SubmititJob:
        request: _Request = plan.request
        request.folder.mkdir(parents=True, exist_ok=True)
        # Submission from inside a job must not pass that job's SLURM_* sizing on (SLURM_CONF
        # kept); submitit reads os.environ itself, hence the temporary scrub.
        with scrubbed_environ(self.cluster_env):
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
        if not self.job.done():
            return "RUNNING"
        if self._cancelled:
            return "CANCELLED"
        # submitit pickles ("success", value) or ("error", traceback) when the task ends.
        pickle = self.job.paths.result_pickle
        ok = pickle.exists() and submitit.core.utils.pickle_load(pickle)[0] == "success"
        return "COMPLETED" if ok else "FAILED"

    def wait(self, timeout_s: float | None = None) -> Finished:
        if self._finished is not None:
            return self._finished
        follower = LogFollower(self.output, self.follow)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (state := self.status()) not in TERMINAL:
            follower.poll()
            if deadline is not None and time.monotonic() > deadline:
                self.cancel()
                raise HpcDdpError(
                    f"submitit job {self.job_id} not done after {timeout_s:.0f} s: cancelled it",
                    hint="raise --timeout, or look at the job's logs in its folder",
                )
            time.sleep(0.2)
        follower.poll()
        count = restarts(self._info())
        try:
            result = self.job.results()[0]  # rank 0's: the trainer writes result.json there
        except Exception as err:  # submitit re-raises the task's error, with its traceback
            done = Finished(self.job_id, state, 1, count, self.output, error=str(err))
        else:
            summary = result if isinstance(result, dict) else {}
            code = int(summary.get("exit_code", 0))
            done = Finished(self.job_id, state, code, count, self.output, summary or None)
        self._finished = done
        return done

    def cancel(self) -> None:
        if self._finished is not None:
            return
        self._cancelled = True
        if self._client is not None:
            self._client.cancel(self.job_id)
        else:
            self.job.cancel(check=False)
