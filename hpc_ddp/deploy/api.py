"""``describe`` and ``submit``: every backend from Python, as ``hpc-ddp submit``/``launch`` use it.

    plan = hpc_ddp.describe(spec)                  # the sbatch script, nothing runs
    job = hpc_ddp.submit(spec, wait=False)         # queued: job.job_id, job.status()
    done = job.wait(timeout_s=600)                 # Finished(state, exit_code, result...)

A job is a ``JobSpec`` (executor sbatch, submitit or local), a ``LaunchSpec`` (its tool, pdsh or
clush, is the executor), or a path: a ``.toml``/``.json`` spec file, or a rendered batch script
(sbatch only). Slurm is the one this environment points at (SLURM_CONF, /etc/slurm) unless
``cluster_env`` names another, e.g. ``hpc_ddp.localslurm.ensure_local_cluster()``'s. Torch-free;
submitit is imported only for its two executors.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.deploy.backend import Backend, DryRun, Job
from hpc_ddp.deploy.executors import EXECUTOR_NAMES, executor_info
from hpc_ddp.deploy.shell.spec import LaunchSpec
from hpc_ddp.deploy.spec import JobSpec, build_spec
from hpc_ddp.errors import ConfigError
from hpc_ddp.extras import require

SPEC_SUFFIXES = (".toml", ".json")
PRODUCER = "hpc_ddp.submit"

JobLike = JobSpec | LaunchSpec | str | Path


def get_backend(
    executor: str,
    *,
    cluster_env: Mapping[str, str] | None = None,
    folder: str | Path | None = None,
    cwd: str | Path | None = None,
    follow: TextIO | None = None,
    produced_by: str = PRODUCER,
) -> Backend:
    """The backend of ``executor``; ``follow`` receives the job's log (pdsh/clush: its output)
    as it grows, ``produced_by`` is recorded in a rendered script's header."""
    info = executor_info(executor)
    if info is not None:
        if info.extra is not None:
            require(info.extra, f"--executor {executor}")
        return info.backend(
            info.name,
            cluster_env=cluster_env,
            folder=folder,
            cwd=cwd,
            follow=follow,
            produced_by=produced_by,
        )
    raise ConfigError(
        f"executor {executor!r} is not one of {', '.join(EXECUTOR_NAMES)}",
        hint="sbatch or submitit/local for a JobSpec; a LaunchSpec runs with its tool",
    )


def as_spec(job: JobLike, executor: str | None) -> tuple[Any, str]:
    """(what the backend describes, the executor): spec files are read, defaults filled in."""
    if isinstance(job, LaunchSpec):
        if executor not in (None, job.tool):
            raise ConfigError(
                f"a launch spec runs with its tool, {job.tool}, not executor {executor!r}",
                hint="leave executor out, or build the spec with tool=...",
            )
        return job, job.tool
    executor = executor or "sbatch"
    info = executor_info(executor)
    if info is not None and info.launch_spec:
        raise ConfigError(
            f"executor {executor} needs a LaunchSpec (hosts, tool), not {type(job).__name__}",
            hint="build one with hpc_ddp.make_launch_spec(tool=..., hosts=..., command=[...])",
        )
    if isinstance(job, JobSpec):
        return job, executor
    path = Path(job)
    if not path.exists():  # what exists but is no file (a FIFO, a device) its reader names
        raise ConfigError(f"{path} does not exist", hint="give a jobs/*.sbatch file or a spec")
    if path.suffix in SPEC_SUFFIXES:
        return build_spec(path), executor
    if info is None or not info.batch_script:
        raise ConfigError(
            f"--executor {executor} needs a job spec (.toml/.json), got {path}",
            hint="use the spec in jobs/specs/, or --executor sbatch for a rendered script",
        )
    return path, executor


def describe(job: JobLike, executor: str | None = None, **options: Any) -> DryRun:
    """What ``submit`` would run, as text (the sbatch or launch script); runs nothing.
    ``options`` are ``get_backend``'s."""
    spec, executor = as_spec(job, executor)
    return get_backend(executor, **options).describe(spec)


def submit(
    job: JobLike,
    executor: str | None = None,
    *,
    wait: bool = True,
    timeout_s: float | None = None,
    follow: TextIO | None = None,
    cluster_env: Mapping[str, str] | None = None,
    folder: str | Path | None = None,
    cwd: str | Path | None = None,
) -> Job:
    """Submit ``job`` and return its handle; with ``wait`` (the default), once it has ended
    (``job.wait()`` then returns how, at once). ``timeout_s``: cancel the job if it has not
    ended by then (None: wait as long as it takes). ``folder``: submitit's logs and pickles
    (default runs/submitit/NAME). ``cwd``: the submission directory (default: this one)."""
    spec, executor = as_spec(job, executor)
    backend = get_backend(executor, cluster_env=cluster_env, folder=folder, cwd=cwd, follow=follow)
    handle = backend.submit(backend.describe(spec))
    if wait:
        handle.wait(timeout_s)
    return handle
