"""``hpc-ddp submit JOB``: submit a job and follow it to the end; exits with the job's exit code.

JOB is a rendered script (``jobs/*.sbatch``) or a spec (``.toml``/``.json``, rendered on the
fly). Executors: ``sbatch`` (default, real sbatch), ``submitit`` (submitit's AutoExecutor on the
same Slurm) and ``local`` (submitit's LocalExecutor, no Slurm at all; spec only). With no Slurm
reachable, the embedded local cluster is started (hpc_ddp.localslurm.embedded.choose_slurm).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_ddp import schema
from hpc_ddp.deploy.api import as_spec, get_backend
from hpc_ddp.deploy.backend import Finished, Job
from hpc_ddp.deploy.executors import EXECUTOR_NAMES, EXECUTORS, canonical
from hpc_ddp.deploy.program import result_lines
from hpc_ddp.deploy.safe_text import comment_text
from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.slurm_client import SlurmTarget
from hpc_ddp.submission import choose_slurm_target

# The executors of a JobSpec; pdsh and clush run a LaunchSpec (`hpc-ddp launch`).
JOB_EXECUTORS = tuple(name for name in EXECUTOR_NAMES if not EXECUTORS[canonical(name)].launch_spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=Path, help="a rendered .sbatch script or a .toml/.json spec")
    parser.add_argument(
        "--executor",
        choices=JOB_EXECUTORS,
        default="sbatch",
        help="sbatch (default); submitit or slurm: submitit's AutoExecutor on Slurm; "
        "local: submitit's LocalExecutor on this machine (spec files only)",
    )
    parser.add_argument(
        "--wait-timeout",
        type=schema.number_type(float, schema.WAIT_S),
        default=3600,
        metavar="SECONDS",
        help="how long this command waits for the job before cancelling it (not the job's "
        "time limit: that is the spec's time)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what would be submitted (the batch script; submitit: its parameters and "
        "every task's command) and submit nothing",
    )
    parser.add_argument("--no-wait", action="store_true", help="print the job id and return")
    parser.add_argument("--quiet", action="store_true", help="do not follow the job's log")
    parser.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="submitit: logs and pickles (default runs/submitit/NAME, NAME the spec's name); "
        "created 0700, an existing one must be yours and writable by nobody else",
    )


def run(args: argparse.Namespace) -> int:
    spec, executor = as_spec(args.job, canonical(args.executor))
    info = EXECUTORS[executor]
    options = dict(folder=args.folder, produced_by=f"hpc-ddp submit {args.job}")
    # Described before a cluster is started: whatever is wrong with the job fails first.
    plan = get_backend(executor, **options).describe(spec)
    if args.dry_run:
        print(plan.text, end="")
        return 0
    # A rendered script's needs are in its #SBATCH lines, which Slurm itself holds it to; a
    # range of nodes needs its MIN.
    nodes, gpus = (spec.node_range[0], spec.gpus_per_node) if isinstance(spec, JobSpec) else (1, 0)
    slurm = choose_slurm_target(nodes, gpus) if info.needs_slurm else None
    cluster_env = None if slurm is None else dict(slurm.env)
    follow = None if args.quiet else sys.stdout
    job = get_backend(executor, cluster_env=cluster_env, follow=follow, **options).submit(plan)
    folder = getattr(job, "folder", None)  # a SubmititJob's: its logs and pickles
    line = info.submitted.format(
        executor=executor, job_id=job.job_id, log=job.output, folder=folder
    )
    print(line, flush=True)
    if args.no_wait:
        _still_running(slurm)
        return 0
    done = job.wait(args.wait_timeout)
    print(_report(executor, spec, job, done, followed=follow is not None))
    _still_running(slurm)
    return done.exit_code


def _report(
    executor: str, spec: JobSpec | Path, job: Job, done: Finished, *, followed: bool
) -> str:
    """How the job ended, and where the run's result.json and plot.png are. The result's lines
    only where the job's log was not followed: the trainer prints them at its end."""
    head = f"job {done.job_id}: {done.state}, exit code {done.exit_code}"
    if not EXECUTORS[executor].batch_report:  # submitit: rank 0's return value carries the result
        if done.error:
            return f"{head}\n  error: {done.error}"
    else:
        head += f", restarts {done.restarts}"
        if job.run_paths is None:
            return f"{head}\n{_no_run_dir(spec)}: no result.json to show"
        if done.result is None:
            return f"{head}\n{job.run_paths.result} does not exist: the job wrote none"
    if job.run_paths is None or done.result is None:
        return head
    paths = job.run_paths
    if followed:
        lines = [head, f"result: {paths.result} (its lines are above, at the end of the log)"]
    else:
        # A program of the user's writes result.json as it likes: its text is shown escaped.
        result = [comment_text(line) for line in result_lines(done.result, job.program)]
        lines = [head, f"result ({paths.result}):", *result]
    if paths.plot.is_file():
        lines.append(f"plot: {paths.plot} (loss and accuracy per epoch)")
    return "\n".join(lines)


def _still_running(slurm: SlurmTarget | None) -> None:
    """The embedded cluster outlives the command (status, logs and the next submit use it):
    say so, and how to stop it."""
    if slurm is not None and slurm.local_root is not None:
        print(
            f"the embedded local cluster in {slurm.local_root} keeps running (status, logs, "
            "cancel and the next submit use it): `hpc-ddp cluster down` stops it"
        )


def _no_run_dir(spec: JobSpec | Path) -> str:
    """Why a job has no run dir (a trainer always has one: its --run-dir or the default)."""
    if isinstance(spec, JobSpec):
        program = spec.script or f"-m {spec.module}"
        return f"the spec gives its program ({program}) no --run-dir"
    return f"{spec} has no `python -m hpc_ddp.train` line, so its run dir is unknown"
