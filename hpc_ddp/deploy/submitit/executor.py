"""``Executor``: any Python function on Slurm (submitit's AutoExecutor) or on this machine
(submitit's LocalExecutor), every task with the distributed environment established.

    ex = hpc_ddp.Executor("runs/fn", cluster="slurm", distributed=True)
    ex.update_parameters(nodes=2, procs_per_node=4, time="30", qos="high")  # JobSpec names
    job = ex.submit(train, lr=0.1)          # submitit.Job; job.results(): every rank's return
    jobs = ex.map_array(train, [0.1, 0.01]) # one array task per value

Parameters are ``JobSpec`` fields (checked as a spec is: every problem at once, by name) and
reach Slurm through ``hpc_ddp.deploy.submitit.parameters``; any other name goes to submitit's
``update_parameters`` unchanged (``slurm_mail_type``...), after the spec's, so it wins.
This module imports submitit only when an executor is made (it is an optional extra).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from hpc_ddp.deploy.sbatch.render import job_env
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.deploy.submission_env import scrubbed_environ, submission_env, with_this_python
from hpc_ddp.deploy.submitit.local_jobs import (
    cancellable_by_sigint,
    local_records,
    remember_local_jobs,
)
from hpc_ddp.deploy.submitit.parameters import Kind, checked_folder, executor_parameters
from hpc_ddp.errors import ConfigError
from hpc_ddp.extras import require
from hpc_ddp.private_paths import ensure_private_dir

if TYPE_CHECKING:
    import submitit

Cluster = Literal["slurm", "local"]
# The variables that name the Slurm to submit to, or a function of the spec that finds them
# (hpc_ddp.Executor's: the user's Slurm, else the embedded cluster, as `hpc-ddp submit` does).
ClusterEnv = Mapping[str, str] | Callable[[JobSpec], Mapping[str, str]]
# The program of a spec: here it is the submitted function.
_PROGRAM_FIELDS = ("module", "script", "args")
_SPEC_FIELDS = frozenset(JobSpec.field_names())


class Executor:
    """submitit's executor interface (``update_parameters``, ``submit``, ``map_array``) for any
    function; each task establishes the distributed environment before calling it.

    ``cluster``: ``"slurm"`` (AutoExecutor, submits with sbatch to the Slurm ``cluster_env``
    names: its variables, or a function of the spec returning them; None: this environment's)
    or ``"local"`` (LocalExecutor: this machine, one node). ``spec``: a ``JobSpec`` to start
    from (its program fields are not used). ``folder``: submitit's logs and pickles, created
    0700; an existing one must be private (``parameters.checked_folder``), and a local job is
    recorded so that ``hpc-ddp cancel`` can prove it is the toolkit's.
    ``distributed=True`` also starts the process group (``hpc_ddp.init_distributed``) in every
    task. Returns submitit's ``Job``.
    """

    def __init__(
        self,
        folder: str | Path,
        cluster: Cluster = "slurm",
        *,
        spec: JobSpec | None = None,
        distributed: bool = False,
        cluster_env: ClusterEnv | None = None,
        **parameters: Any,
    ) -> None:
        require("submitit", "hpc_ddp.Executor")
        if cluster not in ("slurm", "local"):
            raise ConfigError(
                f"Executor cluster {cluster!r} is not one of slurm, local",
                hint='cluster="slurm" submits to Slurm; cluster="local" runs on this machine',
            )
        self.folder = checked_folder(folder)
        self.cluster: Cluster = cluster
        self.spec = spec if spec is not None else JobSpec(name="hpc-ddp-fn")
        self.distributed = distributed
        self._cluster_env = None if cluster == "local" else cluster_env or {}
        self._submitit_parameters: dict[str, Any] = {}
        self.update_parameters(**parameters)

    @property
    def kind(self) -> Kind:
        return "local" if self.cluster == "local" else "submitit"

    @property
    def cluster_env(self) -> dict[str, str] | None:
        """The Slurm jobs go to (found on first use when given as a function), with this
        interpreter (submitit's default) and its venv first on PATH; None for "local"."""
        if self._cluster_env is None:
            return None
        if callable(self._cluster_env):
            self._cluster_env = dict(self._cluster_env(self.spec))
        return with_this_python(self._cluster_env)

    def update_parameters(self, **kwargs: Any) -> None:
        """JobSpec fields (``nodes``, ``procs_per_node``, ``time``, ``qos``, ``mem``,
        ``extra_sbatch``...) update the spec; any other name is submitit's own parameter."""
        program = sorted(set(kwargs) & set(_PROGRAM_FIELDS))
        if program:
            raise ConfigError(
                f"Executor runs the submitted function: {', '.join(program)} do not apply",
                hint="pass the function and its arguments to submit(fn, *args)",
            )
        fields = {k: v for k, v in kwargs.items() if k in _SPEC_FIELDS}
        if fields:
            self.spec = self.spec.replace(**fields)
        self._submitit_parameters.update({k: v for k, v in kwargs.items() if k not in fields})

    def parameters(self) -> dict[str, Any]:
        """What submitit's ``update_parameters`` gets: the spec's, then the submitit names."""
        params = executor_parameters(self.spec, self.kind)
        for key, value in self._submitit_parameters.items():
            if key == "slurm_additional_parameters" and key in params:
                params[key] = {**params[key], **value}
            else:
                params[key] = value
        return params

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> submitit.Job[Any]:
        """Run ``fn(*args, **kwargs)`` in every task; ``job.results()`` lists every rank's
        return value (rank order), ``job.result()`` is it for a one-task job."""
        with scrubbed_environ(self.cluster_env), cancellable_by_sigint():
            job = self._executor().submit(self._task(fn), *args, **kwargs)
        return self._track([job])[0]

    def map_array(
        self, fn: Callable[..., Any], *iterables: Iterable[Any]
    ) -> list[submitit.Job[Any]]:
        """One Slurm array task (one job each under the local executor) per element, as
        ``map(fn, *iterables)``: each runs ``fn`` with the whole spec's shape."""
        with scrubbed_environ(self.cluster_env), cancellable_by_sigint():
            jobs = self._executor().map_array(self._task(fn), *iterables)
        return self._track(jobs)

    def _track(self, jobs: Sequence[Any]) -> list[Any]:
        """Local jobs are recorded, so that `hpc-ddp cancel` can prove they are this toolkit's;
        Slurm jobs get their state from scontrol with the submission's environment, not from
        submitit's sacct polls (hpc_ddp.deploy.submitit.watcher says why)."""
        env = self.cluster_env
        if env is None:
            remember_local_jobs(list(jobs), self.folder)
        else:
            from hpc_ddp.deploy.submitit.watcher import watched_by_scontrol

            watched_by_scontrol(list(jobs), {**submission_env(), **env})
        return list(jobs)

    def _task(self, fn: Callable[..., Any]) -> Any:
        from hpc_ddp.deploy.submitit.function_task import FunctionTask

        if not callable(fn):
            raise ConfigError(f"Executor.submit needs a function, got {fn!r}")
        return FunctionTask(fn, env=dict(job_env(self.spec)), distributed=self.distributed)

    def _executor(self) -> submitit.Executor:
        import submitit

        ensure_private_dir(self.folder)  # submitit's pickles: see parameters.checked_folder
        if self.cluster == "local":
            local_records()  # refused before a job runs, not after
            ex: submitit.Executor = submitit.LocalExecutor(folder=str(self.folder))
        else:
            ex = submitit.AutoExecutor(folder=str(self.folder), cluster="slurm")
        try:
            ex.update_parameters(**self.parameters())
        except (NameError, ValueError, TypeError) as err:  # submitit names what it knows
            raise ConfigError(
                f"submitit refused the executor's parameters: {err}",
                hint="use JobSpec field names, or submitit's own (slurm_* on Slurm)",
            ) from err
        return ex
