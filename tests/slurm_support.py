"""Helpers for tests that use the local Slurm cluster (fixtures live in conftest.py)."""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from hpc_ddp.cluster.master_port import PORT_SPAN
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.localslurm import LocalCluster, SlurmClient, check_prerequisites

VENV_BIN = Path(sys.executable).parent  # not resolved: the venv's python is a symlink
HPC_DDP = VENV_BIN / "hpc-ddp"

# Launcher variables this pytest process may have inherited (it may itself run under srun or
# torchrun); left in a job's environment they would override what Slurm tells the tasks.
_LAUNCHER_PREFIXES = ("SLURM_", "SLURMD_", "OMPI_", "PMI_", "PMIX_", "TORCHELASTIC_", "SUBMITIT_")
_LAUNCHER_VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
_LAUNCHER_VARS |= {"MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"}


def clean_job_env(**extra: str) -> dict[str, str]:
    """os.environ minus launcher variables, with the venv's bin dir first on PATH so that
    `srun hpc-ddp ...` and `python` inside jobs are this project's."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _LAUNCHER_VARS
        and not k.startswith(_LAUNCHER_PREFIXES)
        and not (k.startswith("HPC_DDP_") and k != "HPC_DDP_LOCAL_SLURM_DIR")
    }
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
    env.update(extra)
    return env


def require_local_slurm() -> None:
    """Skip (or fail under CI) where the local cluster cannot start."""
    try:
        check_prerequisites()
    except HpcDdpError as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the local Slurm cluster cannot start: {err}")
        pytest.skip(f"local Slurm cluster unavailable: {err.message}")


class SlurmTestCluster(SlurmClient):
    """A running LocalCluster plus the client helpers tests use.

    ``env``: a subprocess environment for Slurm commands (SLURM_CONF, venv first on PATH).
    Inherited: ``sbatch_wait(script, *sbatch_args, timeout_s=..., output=...) -> JobResult``
    (job_id, state, exit_code, signal, output), ``job_state(job_id)``, ``srun(argv)``,
    ``run(argv)``.
    """

    def __init__(self, cluster: LocalCluster) -> None:
        super().__init__(clean_job_env(**cluster.env()), workdir=cluster.root / "jobs")
        self.cluster = cluster
        self.hpc_ddp = str(HPC_DDP)
        self.python = sys.executable

    @property
    def node_names(self) -> tuple[str, ...]:
        return self.cluster.node_names


# A job's master port is derived from its id (20000 + id % PORT_SPAN) and every local cluster's
# jobs run on this one machine. Under pytest-xdist several workers run clusters at once: each
# (worker, role) pair numbers its jobs from its own window of that span, so two jobs of one test
# run never derive the same port. The window's multiple of the span stays random.
CLUSTER_ROLES = ("cpu", "gpu", "other")


def first_job_id(role: str) -> int:
    """A FirstJobId for a test cluster of ``role`` (CLUSTER_ROLES) in this pytest worker: at
    most one cluster per role and worker runs jobs at a time. A window holds PORT_SPAN / (3 x
    workers) ids (1000 for 3 workers): more than a worker's clusters submit."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # both unset without xdist
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    width = PORT_SPAN // (workers * len(CLUSTER_ROLES))
    slot = index * len(CLUSTER_ROLES) + CLUSTER_ROLES.index(role)
    return random.randrange(1, 500) * PORT_SPAN + slot * width


NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


def as_nobody(argv: list[str], env: dict[str, str], cwd: Path | str = "/tmp") -> CompletedProcess:
    """Run ``argv`` as the unprivileged user nobody (uid 65534, no groups)."""
    return subprocess.run(
        [*NOBODY, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )


def require_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {', '.join(missing)} is not installed")
        pytest.skip(f"not installed: {', '.join(missing)} (scripts/install.sh --test)")


def listening(pids: set[int]) -> list[tuple[str, int]]:
    """(local address, pid) of every listening TCP socket that one of ``pids`` holds, read
    from the kernel by `ss`."""
    out = subprocess.run(
        ["ss", "-H", "-ltnp"], capture_output=True, text=True, check=True, timeout=30
    ).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        holders = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        for pid in holders & pids:
            found.append((fields[3].rsplit(":", 1)[0], pid))
    return found


# The real scontrol, then, for a requeue, 3 s before it exits: a reply that comes after the
# requeue's SIGTERM to every process of the job, as it can from a busy slurmctld.
_LATE_REPLY_SCONTROL = """#!/bin/bash
{real} "$@"
rc=$?
if [ "$1" = requeue ]; then sleep 3; fi
exit $rc
"""


def late_reply_scontrol_path(tools: Path, env: dict[str, str]) -> str:
    """A PATH for jobs whose ``scontrol requeue`` answers 3 s late (written into ``tools``), so
    that the SIGTERM Slurm sends every process of a requeued job reaches scontrol first."""
    real = shutil.which("scontrol", path=env["PATH"])
    assert real, env["PATH"]
    tools.mkdir(exist_ok=True)
    (tools / "scontrol").write_text(_LATE_REPLY_SCONTROL.format(real=shlex.quote(real)))
    (tools / "scontrol").chmod(0o755)
    return f"{tools}{os.pathsep}{env['PATH']}"
