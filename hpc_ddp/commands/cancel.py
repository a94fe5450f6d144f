"""``hpc-ddp cancel JOB``: checkpoint, then end the job (it is not requeued); ``--now``: SIGKILL.

Without ``--now`` the job's processes get the signal they checkpoint on (the script's
``--signal``, USR1 by default; submitit's USR2), the command waits until the checkpoint is
written and the job has left RUNNING (``--timeout``), then cancels what is left so that it
never runs again. Prints the final state; exits 0 once the job has ended.
"""

from __future__ import annotations

import argparse
import sys

from hpc_ddp import schema
from hpc_ddp.commands.job_target import add_job_arguments, find_job, say_notes
from hpc_ddp.deploy.job_control import STOP_TIMEOUT_S, cancel_job


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_job_arguments(parser)
    parser.add_argument(
        "--now", action="store_true", help="SIGKILL every process at once: no checkpoint"
    )
    parser.add_argument(
        "--timeout",
        type=schema.number_type(float, schema.Range(0, schema.YEAR_S)),
        default=STOP_TIMEOUT_S,
        help="seconds to wait for the checkpoint before cancelling anyway",
    )


def run(args: argparse.Namespace) -> int:
    job = find_job(args.job, args.folder)
    say_notes(job)
    state = cancel_job(
        job,
        now=args.now,
        timeout_s=args.timeout,
        on_event=lambda msg: print(msg, file=sys.stderr, flush=True),
    )
    print(f"job {job.job_id}: {state}")
    return 0
