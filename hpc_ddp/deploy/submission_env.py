"""The environment a new job is submitted with: nothing of the job we may be running inside.

sbatch/srun read many SLURM_* and SBATCH_*/SRUN_* variables as defaults, and Slurm copies the
submitter's environment into the job. A job submitted from inside a 2x8 job would otherwise
inherit its node count, task layout or GPU binding, and its MASTER_PORT/RANK would override what
the new job's ranks derive. SLURM_CONF is kept: it says which cluster to talk to.
(submitit.helpers.clean_env drops SLURM_CONF too, hence our own.)
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from hpc_ddp.env_vars import JOB_SHELL_VARS, LAUNCH_VARS

SCRUB_PREFIXES = (
    "SLURM_",
    "SLURMD_",
    "SBATCH_",
    "SALLOC_",
    "SRUN_",
    "SUBMITIT_",
    "TORCHELASTIC_",
    "PMI_",
    "PMIX_",
    "OMPI_",
)
SCRUB_NAMES = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "ROLE_RANK",
        "CUDA_VISIBLE_DEVICES",  # set by Slurm for *this* allocation's GPUs
        # The project's own launch contract, its launch tag included: `hpc-ddp launch stop`
        # kills by the tag, and a child job must not match.
        *LAUNCH_VARS,
        *JOB_SHELL_VARS,
    }
)
KEEP = frozenset({"SLURM_CONF"})


def is_scrubbed(name: str) -> bool:
    if name in KEEP:
        return False
    return name in SCRUB_NAMES or name.startswith(SCRUB_PREFIXES)


def submission_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default: ours) without the variables of any enclosing job."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not is_scrubbed(k)}


@contextlib.contextmanager
def scrubbed_environ(extra: Mapping[str, str] | None = None) -> Iterator[None]:
    """Temporarily scrub ``os.environ`` (for libraries such as submitit that read it directly)."""
    saved = dict(os.environ)
    try:
        for key in [k for k in os.environ if is_scrubbed(k)]:
            del os.environ[key]
        os.environ.update(extra or {})
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def with_this_python(cluster_env: Mapping[str, str]) -> dict[str, str]:
    """``cluster_env`` with this interpreter's bin directory first on PATH.

    Slurm copies the submitter's environment into the job, and the rendered scripts run
    ``python``: so the job's ``python`` is the one submitting it (its venv, where hpc-ddp is
    installed), whatever PATH the user's shell has. The bin directory is not resolved: a venv's
    python is a link to the base interpreter, whose directory lacks the venv's packages.
    """
    path = cluster_env.get("PATH", os.environ.get("PATH", ""))
    return {**cluster_env, "PATH": str(Path(sys.executable).parent) + os.pathsep + path}
