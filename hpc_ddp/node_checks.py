"""``hpc_ddp.doctor()``: every check of ``hpc-ddp doctor`` from Python, as a list of ``Check``s.

It composes the deploy layer's node checks (hpc_ddp/deploy/doctor.py) with a job's own
assumptions and the embedded cluster's whereabouts, which the deploy layer never asks itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hpc_ddp.deploy.doctor import Check as Check
from hpc_ddp.deploy.doctor import EmbeddedCluster, Options, run_checks
from hpc_ddp.deploy.job_assumptions import JobAssumptions, job_checks, of_script, of_spec
from hpc_ddp.deploy.spec import build_spec
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.programs import register as register_programs
from hpc_ddp.schema import read_text_file

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
    found = _job_assumptions(Path(job)) if job is not None else None
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


def _job_assumptions(path: Path) -> JobAssumptions:
    """What the job in ``path`` (a spec or a rendered script) assumes of the node."""
    if path.suffix in (".toml", ".json"):
        return of_spec(build_spec(path))
    found = of_script(read_text_file(path, what="batch script"))
    if found is None:
        raise ConfigError(
            f"{path} does not run the hpc_ddp trainer (or another program with a hook): "
            "nothing to check for --job",
            hint="give a script rendered by hpc-ddp render, or its spec file",
        )
    return found


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
