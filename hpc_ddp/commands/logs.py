"""``hpc-ddp logs JOB``: the job's batch log and every rank's log; ``-f`` follows them until
the job ends (``--timeout`` bounds the following)."""

from __future__ import annotations

import argparse
import sys

from hpc_ddp import schema
from hpc_ddp.commands.job_target import add_job_arguments, find_job, say_notes
from hpc_ddp.deploy.job_control import follow_logs, log_paths
from hpc_ddp.errors import HpcDdpError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the job ends"
    )
    parser.add_argument(
        "--timeout",
        type=schema.number_type(float, schema.WAIT_S),
        default=None,
        help="with -f: stop following after this many s",
    )
    parser.add_argument("--list", action="store_true", help="only print the log files' paths")


def run(args: argparse.Namespace) -> int:
    job = find_job(args.job, args.folder)
    say_notes(job)
    if args.list:
        print("\n".join(str(path) for path in log_paths(job)))
        return 0
    if not args.follow and not log_paths(job):
        raise HpcDdpError(
            f"job {job.job_id} has no log yet ({job.status()})",
            hint="a pending job writes none; try again once it runs, or use -f",
        )
    follow_logs(job, sys.stdout, follow=args.follow, timeout_s=args.timeout)
    return 0
