"""The doctor: does this machine (a login node, or inside an allocation) have what a job needs?

``hpc_ddp.doctor()`` gives every check of ``hpc-ddp doctor`` as a list of ``Check``s (OK / WARN /
FAIL, a detail, a hint); the command only prints them. The checks of the node are in
``node.py``, those of a job's own assumptions (``--job FILE``) in ``job.py``; here they are
composed, and told where the embedded cluster runs (the layer above deploy and localslurm, as
``hpc_ddp.submission`` is). A program's hook adds its own (``ProgramHook``'s ``JobNeeds.checks``:
the trainer's data dir). Torch-free: torch is imported only by the torch check, lazily.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.programs import register as register_programs

from .job import job_assumptions, job_checks
from .node import FAIL, OK, WARN, Check, EmbeddedCluster, Options, Status, run_checks

register_programs()  # a job's program is asked about its arguments through its hook


def doctor(
    run_dir: str | Path = "runs",
    *,
    gpus: int | None = None,
    port: int | None = None,
    torch: bool = True,
    job: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Check]:
    """What ``hpc-ddp doctor`` checks, each a ``Check`` (``status`` OK/WARN/FAIL, ``name``,
    ``detail``, ``hint``; ``line()`` as printed). ``job``: a rendered .sbatch or a spec file,
    whose interpreter, data dir and run dir are checked too (``run_dir`` then comes from it)."""
    found = job_assumptions(Path(job)) if job is not None else None
    if found is not None and found.needs is not None and found.needs.run_dir is not None:
        run_dir = Path(found.workdir or ".") / found.needs.run_dir
    options = Options(
        run_dir=Path(run_dir),
        gpus=gpus,
        port=port,
        torch=torch,
        environ=environ,
        embedded_cluster=embedded_cluster,
    )
    checks = run_checks(options)
    if found is not None:
        checks += job_checks(found, Path(found.workdir or "."), torch=torch)
    return checks


def embedded_cluster(environ: Mapping[str, str]) -> EmbeddedCluster | None:
    """The embedded local cluster `hpc-ddp submit` would use here, if it is running."""
    from hpc_ddp.localslurm import LocalCluster, default_state_dir

    root = default_state_dir(environ, create=False)  # a doctor creates nothing
    if not root.exists():
        return None
    try:
        cluster = LocalCluster(root)
    except HpcDdpError:  # an unusable state dir just means no embedded cluster runs there
        return None
    return EmbeddedCluster(cluster.root, cluster.config.nodes) if cluster.is_running() else None


__all__ = ["FAIL", "OK", "WARN", "Check", "Status", "doctor"]
