"""What ``hpc-ddp status``, ``logs`` and ``cancel`` share: finding the job a user names.

Not a command itself. JOB is a Slurm job id (sbatch or submitit on Slurm), or a local submitit
job's id with ``--folder``; ``status`` also takes a run dir. The Slurm asked is the user's, else
the embedded local cluster if it runs (nothing is started).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpc_ddp.deploy.backend import Job
from hpc_ddp.deploy.job_control import attach_job, check_job_id, is_local_job


def add_job_arguments(parser: argparse.ArgumentParser, what: str = "JOB") -> None:
    parser.add_argument(
        "job",
        metavar=what,
        help="the job id `hpc-ddp submit` printed"
        + (", or the trainer's run dir" if what != "JOB" else ""),
    )
    parser.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="submitit's job folder (needed for a local-executor job; found for Slurm jobs); "
        "its pickles are read only if it and they are yours and nobody else can write them",
    )


def find_job(job_id: str, folder: Path | None) -> Job:
    """The handle of ``job_id``; a local submitit job needs no Slurm at all."""
    check_job_id(job_id)  # before any file is named after it, or any Slurm asked
    if folder is not None and is_local_job(folder, job_id):
        return attach_job(job_id, folder=folder)
    from hpc_ddp.localslurm.embedded import running_slurm

    return attach_job(job_id, folder=folder, cluster_env=running_slurm().env)


def say_notes(job: Job) -> None:
    """What was not read about ``job`` and why (a pickle someone else could have written), on
    stderr: for the commands whose output is not a report."""
    for note in getattr(job, "notes", ()):
        print(f"hpc-ddp: note: {note}", file=sys.stderr, flush=True)
