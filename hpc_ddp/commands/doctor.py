"""``hpc-ddp doctor``: check that this machine or allocation has what a job needs.

Prints one OK/WARN/FAIL line per check, with a HINT for the others; exits 1 if anything FAILed.
Run it on the login node before submitting, or as `srun hpc-ddp doctor` inside the allocation.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hpc_ddp import schema
from hpc_ddp.deploy.core import ProcessSpec
from hpc_ddp.doctor_checks import FAIL, WARN, doctor


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run-dir",
        type=Path,
        default=Path("runs"),
        help="checkpoint directory to check (one not created yet: the dir it would be created "
        "in; nothing is created)",
    )
    parser.add_argument(
        "--gpus",
        type=schema.flag_type(ProcessSpec, "gpus_per_node"),
        default=None,
        help="GPUs per node the job will use",
    )
    parser.add_argument(
        "--port",
        type=schema.number_type(int, schema.PORT),
        default=None,
        help="master port to check",
    )
    parser.add_argument(
        "--no-torch",
        action="store_true",
        help="skip importing torch (without torch installed, its checks are skipped anyway)",
    )
    parser.add_argument(
        "--job",
        type=Path,
        default=None,
        metavar="FILE",
        help="a rendered .sbatch or a .toml/.json spec: check its interpreter (imports hpc_ddp "
        "and torch), data dir and run dir here; run it inside an allocation, after the job's "
        "setup lines",
    )
    parser.add_argument(
        "--nccl-dump",
        type=Path,
        metavar="PATH",
        help="read NCCL flight recorder dumps (a rank_N file or <run_dir>/nccl_trace) instead: "
        "per rank the last collective entered and completed, and which ranks lag",
    )


def run(args: argparse.Namespace) -> int:
    if args.nccl_dump is not None:
        from hpc_ddp.deploy.flight_recorder import report

        print("\n".join(report(args.nccl_dump)))
        return 0
    checks = doctor(
        args.run_dir, gpus=args.gpus, port=args.port, torch=not args.no_torch, job=args.job
    )
    for check in checks:
        print(check.line())
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    print(f"{len(checks)} checks: {fails} failed, {warns} warnings")
    return 1 if fails else 0
