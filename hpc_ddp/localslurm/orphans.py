"""Stop ephemeral clusters whose owner died: a killed pytest run must not leave daemons behind.

A cluster started with ``LocalCluster(..., ephemeral=True)`` writes ``run/owner`` ("pid
starttime" of the starting process). ``reap`` stops every such cluster under a parent dir whose
owner no longer exists; clusters without that file (``hpc-ddp cluster up``, the embedded
default) live until someone stops them.
"""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm import private_dir, procs
from hpc_ddp.localslurm.daemons import LocalCluster


def owner_alive(root: Path) -> bool | None:
    """None: not an ephemeral cluster; else whether the process that started it still runs."""
    try:
        owner = (root / "run" / "owner").read_text().strip()
    except OSError:
        return None
    if not owner:
        return None
    pid = int(owner.split()[0])
    return procs.alive(pid) and procs.identity(pid) == owner


def reap(parent: Path, prefix: str) -> list[Path]:
    """Stop and remove orphaned ephemeral clusters in ``parent/<prefix>*`` (or one level below
    them); returns their dirs."""
    reaped = []
    tops = [d for d in sorted(parent.glob(f"{prefix}*")) if d.is_dir()]
    for root in tops + [sub for top in tops for sub in sorted(top.iterdir()) if sub.is_dir()]:
        try:
            private_dir.check(root)  # another user's dir under /tmp is not ours to act on
        except ConfigError:
            continue
        if owner_alive(root) is False:
            LocalCluster(root).stop()
            reaped.append(root)
    return reaped
