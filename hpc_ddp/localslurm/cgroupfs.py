"""What slurmd's cgroup plugin needs of this machine's cgroup v2 tree, made ready before it starts.

Slurm 22.05's slurmd loads its cgroup plugin whatever the proctrack and task plugins are. On
cgroup v2 it keeps slurmstepds in ``/sys/fs/cgroup/system.slice/<node>_slurmstepd.scope``, made
through systemd over D-Bus, or with ``IgnoreSystemd=yes`` (which the local cluster always
sets, so that machines whose init is not systemd work: VMs, containers) by a plain mkdir that
needs system.slice to exist. There, without systemd, nothing has made it: we do, and leave it
(an empty cgroup, where systemd would have one; Slurm leaves its scopes in it too). With the
cgroup plugins on, the scope needs the cpuset, cpu and memory controllers, which system.slice
hands down through its cgroup.subtree_control.
On cgroup v1 (or hybrid) machines none of this applies.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm.config import ClusterConfig

MOUNT = Path("/sys/fs/cgroup")
SCOPE_CONTROLLERS = ("cpuset", "cpu", "memory", "pids")


def is_v2(mount: Path = MOUNT) -> bool:
    return (mount / "cgroup.controllers").is_file()


def system_slice(mount: Path = MOUNT) -> Path:
    """Where Slurm 22.05's slurmd puts its stepd scope: system.slice under the mount point.
    (Later releases put it next to init's own cgroup; seen on a VM whose init lives in
    /process_api/core, 22.05.8 still asked for /sys/fs/cgroup/system.slice/<node>_...scope.)"""
    return mount / "system.slice"


def prepare(controllers: bool, mount: Path = MOUNT) -> None:
    """Make system.slice if it is missing; hand its controllers down when cgroups are on."""
    if not is_v2(mount):
        return
    slice_dir = system_slice(mount)
    if not slice_dir.exists():
        try:
            slice_dir.mkdir()
        except OSError as err:
            raise HpcDdpError(
                f"slurmd needs the cgroup {slice_dir}, which cannot be created: {err}",
                hint="run where /sys/fs/cgroup is writable by root (not a read-only container "
                "mount), or start slurmd under systemd",
            ) from None
    if controllers:
        available = (slice_dir / "cgroup.controllers").read_text().split()
        for name in SCOPE_CONTROLLERS:
            if name in available:
                (slice_dir / "cgroup.subtree_control").write_text(f"+{name}\n")


def check_cores(cfg: ClusterConfig) -> None:
    """With cgroups, slurmd binds each task to the CPUs it declared: they must exist."""
    cores = os.cpu_count() or 1
    if cfg.cgroups and cfg.cpus_per_node > cores:
        raise ConfigError(
            f"with cgroups each node's {cfg.cpus_per_node} CPUs must exist: this machine "
            f"has {cores}",
            hint=f"--cpus-per-node {cores} or fewer (without --cgroups any number works)",
        )
