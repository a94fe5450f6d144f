"""``hpc-ddp submit JOB``: submit a job and follow it to the end; exits with the job's exit code.

JOB is a rendered script (``jobs/*.sbatch``) or a spec (``.toml``/``.json``, rendered on the
fly). Executors: ``sbatch`` (default, real sbatch), ``submitit`` (submitit's AutoExecutor on the
same Slurm) and ``local`` (submitit's LocalExecutor, no Slurm at all; spec only). With no Slurm
reachable, the embedded local cluster is started (hpc_ddp.localslurm.embedded.choose_slurm).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from hpc_ddp.errors import ConfigError
from hpc_ddp.extras import require

# "slurm" is another name for "submitit" (submitit's AutoExecutor on the Slurm cluster).
EXECUTORS = ("sbatch", "submitit", "slurm", "local")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", type=Path, help="a rendered .sbatch script or a .toml/.json spec")
    parser.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="sbatch",
        help="sbatch (default); submitit or slurm: submitit's AutoExecutor on Slurm; "
        "local: submitit's LocalExecutor on this machine (spec files only)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds to wait before cancelling the job"
    )
    parser.add_argument("--no-wait", action="store_true", help="print the job id and return")
    parser.add_argument("--quiet", action="store_true", help="do not follow the job's log")
    parser.add_argument(
        "--folder",
        type=Path,
        default=None,
        help="submitit: logs and pickles (default runs/submitit)",
    )


def _cluster_env(nodes: int, gpus_per_node: int) -> dict[str, str]:
    from hpc_ddp.localslurm.embedded import choose_slurm

    target = choose_slurm(nodes=max(nodes, 2), gpus_per_node=gpus_per_node)
    print(f"Slurm: {target.description}", flush=True)  # which cluster the job goes to
    env = dict(target.env)
    # Jobs run `python`: make it this interpreter (the venv's), whatever PATH the user has.
    bindir = str(Path(sys.executable).parent)
    env["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    return env


def run(args: argparse.Namespace) -> int:
    job: Path = args.job
    if not job.is_file():
        raise ConfigError(f"{job} does not exist", hint="give a jobs/*.sbatch file or a spec")
    if args.executor == "sbatch":
        return _run_sbatch(args, job)
    if job.suffix not in (".toml", ".json"):
        raise ConfigError(
            f"--executor {args.executor} needs a job spec (.toml/.json), got {job}",
            hint="use the spec in jobs/specs/, or --executor sbatch for a rendered script",
        )
    require("submitit", f"--executor {args.executor}")
    from hpc_ddp.deploy.submitit.backend import run_spec

    executor = "submitit" if args.executor == "slurm" else args.executor
    return run_spec(
        job,
        executor=executor,
        folder=args.folder,
        timeout_s=args.timeout,
        wait=not args.no_wait,
        follow=None if args.quiet else sys.stdout,
        cluster_env=None if executor == "local" else _cluster_env(2, 0),
    )


def _run_sbatch(args: argparse.Namespace, job: Path) -> int:
    from hpc_ddp.deploy import build_spec
    from hpc_ddp.deploy.sbatch.render import render
    from hpc_ddp.deploy.sbatch.submit import (
        print_finished,
        result_summary,
        run_dir_of,
        sbatch,
        wait_job,
    )

    cwd = Path.cwd()
    nodes, gpus = 2, 0
    if job.suffix in (".toml", ".json"):
        spec = build_spec(job)
        nodes, gpus = spec.nodes, spec.gpus_per_node
        text = render(spec, command=f"hpc-ddp submit {job}")
        fd, tmp = tempfile.mkstemp(prefix=f"{spec.name}-", suffix=".sbatch")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        script = Path(tmp)
    else:
        script, text = job, job.read_text()
    env = _cluster_env(nodes, gpus)
    try:
        sub = sbatch(script, env, cwd=cwd)
    finally:
        if script != job:
            script.unlink(missing_ok=True)
    print(f"submitted job {sub.job_id}; log: {sub.output}", flush=True)
    if args.no_wait:
        return 0
    done = wait_job(
        sub.job_id,
        env,
        timeout_s=args.timeout,
        output=sub.output,
        follow=None if args.quiet else sys.stdout,
    )
    print_finished(done)
    print(result_summary(run_dir_of(text, cwd)))
    return done.exit_code
