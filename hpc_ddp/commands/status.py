"""``hpc-ddp status JOB|RUN_DIR``: a job's state, requeues, nodes, progress and result.

JOB: what ``hpc-ddp submit`` printed (sbatch or submitit; ``--folder`` for a local submitit
job). RUN_DIR: the trainer's run dir; its job, when Slurm still knows it, is asked too.
``--json`` prints the same as one JSON object. Exits 0 (the job's own outcome is in the text).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from pathlib import Path

from hpc_ddp.commands.job_target import add_job_arguments, find_job
from hpc_ddp.deploy.job_control import job_report, run_dir_job, run_dir_report
from hpc_ddp.errors import HpcDdpError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser, "JOB|RUN_DIR")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    target = Path(args.job)
    if target.is_dir():
        job_id = run_dir_job(target)
        report = run_dir_report(target)
        if job_id is not None:
            # Slurm may have forgotten the job (or be gone): then the run dir is all there is.
            with contextlib.suppress(HpcDdpError):
                report = dataclasses.replace(
                    job_report(find_job(job_id, args.folder)), run_dir=report.run_dir,
                    progress=report.progress, result=report.result,
                )  # fmt: skip
    else:
        report = job_report(find_job(args.job, args.folder))
    if args.json:
        print(json.dumps(dataclasses.asdict(report), default=str, indent=2))
    else:
        print("\n".join(report.lines()))
    return 0
