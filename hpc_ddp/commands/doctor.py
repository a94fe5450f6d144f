"""``hpc-ddp doctor``: check that this machine or allocation has what a job needs.

Prints one OK/WARN/FAIL line per check, with a HINT for the others; exits 1 if anything FAILed.
Run it on the login node before submitting, or as `srun hpc-ddp doctor` inside the allocation.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.deploy.doctor import FAIL, WARN, EmbeddedCluster, Options, run_checks
from hpc_ddp.deploy.job_assumptions import JobAssumptions, job_checks, of_script, of_spec
from hpc_ddp.deploy.spec import build_spec
from hpc_ddp.errors import ConfigError, HpcDdpError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run-dir", type=Path, default=Path("runs"), help="checkpoint directory")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs per node the job will use")
    parser.add_argument("--port", type=int, default=None, help="master port to check")
    parser.add_argument("--no-torch", action="store_true", help="skip importing torch")
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
    job = _job_assumptions(args.job) if args.job else None
    run_dir = args.run_dir
    if job is not None and job.trainer is not None:
        run_dir = Path(job.workdir or ".") / job.trainer.run_dir
    checks = run_checks(
        Options(
            run_dir=run_dir,
            gpus=args.gpus,
            port=args.port,
            torch=not args.no_torch,
            embedded_cluster=embedded_cluster,
        )
    )
    if job is not None:
        checks += job_checks(job, Path(job.workdir or "."), torch=not args.no_torch)
    for check in checks:
        print(check.line())
    fails = sum(c.status == FAIL for c in checks)
    warns = sum(c.status == WARN for c in checks)
    print(f"{len(checks)} checks: {fails} failed, {warns} warnings")
    return 1 if fails else 0


def _job_assumptions(path: Path) -> JobAssumptions:
    """What the job in ``path`` (a spec or a rendered script) assumes of the node."""
    if path.suffix in (".toml", ".json"):
        return of_spec(build_spec(path))
    try:
        found = of_script(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}", hint="check the path") from None
    if found is None:
        raise ConfigError(
            f"{path} does not run the hpc_ddp trainer: nothing to check for --job",
            hint="give a script rendered by hpc-ddp render, or its spec file",
        )
    return found


def embedded_cluster(environ: Mapping[str, str]) -> EmbeddedCluster | None:
    """The embedded local cluster `hpc-ddp submit` would use here, if it is running."""
    from hpc_ddp.localslurm import LocalCluster, default_state_dir

    try:
        cluster = LocalCluster(default_state_dir(environ))
    except HpcDdpError:  # an unusable state dir just means no embedded cluster runs there
        return None
    return EmbeddedCluster(cluster.root, cluster.config.nodes) if cluster.is_running() else None
