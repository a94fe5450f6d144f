"""Where submissions go: the user's Slurm if its tools reach one, else the toolkit's own cluster.

Which Slurm answers is hpc_ddp.slurm_client's to say (``hpc-ddp doctor`` asks it too); this
module adds the embedded cluster: where it lives, and starting it when nothing else answers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from filelock import FileLock

from hpc_ddp.env_vars import LOCAL_SLURM_DIR_VAR, SLURM_VAR
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm import private_dir
from hpc_ddp.localslurm.daemons import LocalCluster
from hpc_ddp.private_paths import ensure_private_dir, lasting_state_base
from hpc_ddp.slurm_client import SlurmTarget, reachable_slurm

# The embedded cluster's smallest shape: a one-node job starts two nodes, so that the two-node
# job that usually follows (the README's demo) finds a cluster it fits in.
START_NODES = 2


def default_state_dir(environ: Mapping[str, str] | None = None, *, create: bool = True) -> Path:
    """$LOCAL_SLURM_DIR_VAR, else ``slurm`` in the toolkit's lasting per-user state dir
    (~/.local/state/hpc-ddp), which is created 0700 or checked (hpc_ddp.private_paths); with
    ``create=False`` only named (a look for a running cluster must leave no dir behind). The
    cluster dir itself is the cluster's to create, root's alone (private_dir.py)."""
    env = os.environ if environ is None else environ
    if env.get(LOCAL_SLURM_DIR_VAR):
        return Path(env[LOCAL_SLURM_DIR_VAR]).absolute()
    base = lasting_state_base(env)
    return (ensure_private_dir(base) if create else base) / "slurm"


def dir_lock(root: Path, timeout_s: float = 60) -> FileLock:
    """Serialises start/stop of the cluster in ``root`` between processes. The lock file sits
    beside root (not in it: stop removes root), so the dirs above root must pass the cluster
    dir's rules first (private_dir.check_ancestors)."""
    private_dir.check_ancestors(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(root.parent / f".{root.name}.lock"), timeout=timeout_s)


def users_slurm(environ: Mapping[str, str] | None = None) -> SlurmTarget | None:
    """The user's own Slurm (:func:`hpc_ddp.slurm_client.reachable_slurm`), unless
    ``SLURM_VAR=local`` asks for the embedded cluster; None then and where no Slurm answers."""
    env = os.environ if environ is None else environ
    if env.get(SLURM_VAR) == "local":
        return None
    return reachable_slurm(env)


def choose_slurm(
    nodes: int = 2,
    cpus_per_node: int = 4,
    gpus_per_node: int = 0,
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30,
) -> SlurmTarget:
    """The user's Slurm (users_slurm), else the embedded cluster.

    ``nodes`` and ``gpus_per_node``: what the job needs. The embedded cluster lives in
    ``default_state_dir()``; it is reused while it runs (by any process) if it has that much,
    started otherwise (with at least START_NODES nodes). A file lock beside its dir makes
    concurrent callers agree.
    """
    existing = users_slurm(environ)
    if existing is not None:
        return existing
    root = default_state_dir(environ)
    with dir_lock(root, timeout_s + 30):
        cluster = LocalCluster(root, max(nodes, START_NODES), cpus_per_node, gpus_per_node)
        if cluster.is_running():
            have = cluster.config
            if have.nodes < nodes or have.gpus_per_node < gpus_per_node:
                raise ConfigError(
                    f"the local cluster in {root} has {have.nodes} node(s) with "
                    f"{have.gpus_per_node} GPU(s) each; {nodes} x {gpus_per_node} were asked for",
                    hint="stop it (hpc-ddp cluster down) and start a bigger one "
                    "(hpc-ddp cluster up --nodes N --gpus-per-node G)",
                )
        else:
            cluster = LocalCluster(root, max(nodes, START_NODES), cpus_per_node, gpus_per_node)
            cluster.start(timeout_s)
    cfg = cluster.config
    return SlurmTarget(
        cluster.env(),
        f"the embedded local cluster in {root} ({cfg.nodes} nodes, only root can use it; "
        f"SLURM_CONF={cluster.conf_path})",
        local_root=root,
    )


def ensure_local_cluster(
    nodes: int = 2,
    cpus_per_node: int = 4,
    gpus_per_node: int = 0,
    *,
    environ: Mapping[str, str] | None = None,
    timeout_s: float = 30,
) -> dict[str, str]:
    """The variables Slurm clients need: ``choose_slurm(...).env``."""
    return choose_slurm(
        nodes, cpus_per_node, gpus_per_node, environ=environ, timeout_s=timeout_s
    ).env


def running_slurm(environ: Mapping[str, str] | None = None) -> SlurmTarget:
    """The Slurm a submitted job lives in: the user's (users_slurm), else the embedded cluster
    if it runs. Starts nothing: asking about a job must not start a cluster."""
    existing = users_slurm(environ)
    if existing is not None:
        return existing
    root = default_state_dir(environ)
    cluster = LocalCluster(root)
    if not cluster.is_running():
        raise HpcDdpError(
            f"no Slurm answers here and the embedded cluster in {root} is not running",
            hint="set SLURM_CONF to the cluster the job went to (`hpc-ddp cluster status`)",
        )
    return SlurmTarget(cluster.env(), f"the embedded local cluster in {root}", local_root=root)
