"""The embedded cluster in a dir, started, stopped and asked about: what ``hpc-ddp cluster
up|down|status|env`` do, for the CLI and for Python callers (``hpc_ddp.cluster_up`` and its
siblings) alike. Torch-free.

``dir`` None means the default cluster dir (``embedded.default_state_dir``). Starting and
stopping hold the dir's file lock, so two callers never start two clusters in one dir or stop
one while it starts.
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm.daemons import LocalCluster
from hpc_ddp.localslurm.embedded import default_state_dir, dir_lock
from hpc_ddp.localslurm.gpus import parse_devices, per_node


@dataclass(frozen=True)
class ClusterUp:
    """What ``cluster_up`` found or did."""

    cluster: LocalCluster  # running
    start_s: float | None  # seconds the start took; None: one already ran in the dir


def cluster_root(dir: Path | str | None = None) -> Path:
    """The cluster dir that ``dir`` names (None: the default one), absolute."""
    return Path(dir).absolute() if dir is not None else default_state_dir().absolute()


def cluster_up(
    dir: Path | str | None = None,
    *,
    nodes: int = 2,
    cpus_per_node: int = 4,
    gpus_per_node: int | None = None,
    gpu_devices: str | None = None,
    port: int | None = None,
    slurm_root: Path | str | None = None,
    cgroups: bool = False,
    timeout_s: float = 30,
) -> ClusterUp:
    """Start the cluster in ``dir`` and wait until every node is idle, or keep the one already
    running there (then the arguments are not compared with it). ``gpu_devices``: ``"auto"``
    (every /dev/nvidiaN) or comma-separated device files, shared out to the nodes in order;
    without it ``gpus_per_node`` fake GPUs (default 0). Raises HpcDdpError on bad input or a
    failed start, which undoes itself."""
    root = cluster_root(dir)
    with dir_lock(root, timeout_s + 30):
        real_gpus, per_node_gpus = _gpus(nodes, gpus_per_node, gpu_devices)
        cluster = LocalCluster(
            root,
            nodes,
            cpus_per_node,
            per_node_gpus,
            port,
            slurm_root=Path(slurm_root).absolute() if slurm_root else None,
            real_gpus=real_gpus,
            cgroups=cgroups,
        )
        if cluster.is_running():
            return ClusterUp(cluster, None)
        started = time.monotonic()
        cluster.start(timeout_s)
        return ClusterUp(cluster, time.monotonic() - started)


def _gpus(
    nodes: int, gpus_per_node: int | None, gpu_devices: str | None
) -> tuple[tuple[str, ...], int]:
    """(real GPU device files, GPUs per node) from ``gpu_devices`` and ``gpus_per_node``."""
    if gpu_devices is None:
        return (), gpus_per_node or 0
    devices = parse_devices(gpu_devices)
    share = len(per_node(devices, nodes)[0])
    if gpus_per_node not in (None, share):
        raise ConfigError(
            f"--gpus-per-node {gpus_per_node} but --gpu-devices gives each of the "
            f"{nodes} node(s) {share}",
            hint="leave --gpus-per-node out with --gpu-devices",
        )
    return devices, share


def cluster_down(dir: Path | str | None = None) -> bool:
    """Cancel the cluster's jobs, stop its daemons and remove its dir; whether the dir existed.
    Also cleans up after a cluster whose dir is gone (its daemons, its hosts line). A dir that
    is not a cluster's is refused untouched (ConfigError)."""
    root = cluster_root(dir)
    with dir_lock(root):
        existed = root.exists()
        LocalCluster(root).stop()
    return existed


def running_cluster(dir: Path | str | None = None) -> LocalCluster | None:
    """The cluster running in ``dir``, or None (``hpc-ddp cluster status``). Starts nothing."""
    cluster = LocalCluster(cluster_root(dir))
    return cluster if cluster.is_running() else None


def cluster_env(dir: Path | str | None = None) -> dict[str, str]:
    """The variables a Slurm client (sbatch, srun, squeue, submitit) needs to reach the cluster
    running in ``dir``: SLURM_CONF, and for an unpacked Slurm PATH and LD_LIBRARY_PATH with its
    dirs first. Raises HpcDdpError when none runs there."""
    return _running(dir).env()


def cluster_env_script(dir: Path | str | None = None) -> str:
    """``cluster_env`` as the shell lines ``hpc-ddp cluster env`` prints for ``eval``: PATH and
    LD_LIBRARY_PATH keep what the evaluating shell already has, behind the cluster's dirs."""
    cluster = _running(dir)
    lines = [f"export SLURM_CONF={shlex.quote(str(cluster.conf_path))}"]
    for key, prefix in cluster.install.shell_exports():
        lines.append(f'export {key}={shlex.quote(prefix)}"${{{key}:+:${key}}}"')
    return "\n".join(lines)


def _running(dir: Path | str | None) -> LocalCluster:
    root = cluster_root(dir)
    cluster = running_cluster(root)
    if cluster is None:
        raise HpcDdpError(f"no local cluster running in {root}", hint="hpc-ddp cluster up")
    return cluster
