"""``hpc-ddp cluster up|down|status|env``: the embedded local Slurm cluster."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from hpc_ddp.env_vars import LOCAL_SLURM_DIR_VAR
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.localslurm import LocalCluster
from hpc_ddp.localslurm.config import NODE_ADDR
from hpc_ddp.localslurm.embedded import default_state_dir, dir_lock


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start the cluster (or keep the one already running)")
    up.add_argument("--nodes", type=int, default=2, help="slurmd 'nodes' (default 2)")
    up.add_argument("--cpus-per-node", type=int, default=4, help="CPUs declared per node")
    up.add_argument("--gpus-per-node", type=int, default=0, help="fake GPUs per node (gres)")
    up.add_argument("--port", type=int, default=None, help="slurmctld port (default: a free one)")
    up.add_argument("--timeout", type=float, default=30, help="seconds to wait for idle nodes")
    down = sub.add_parser("down", help="cancel jobs, stop the daemons, remove the cluster dir")
    status = sub.add_parser("status", help="is it running? (exit 0 yes, 1 no)")
    env = sub.add_parser("env", help="print `export SLURM_CONF=...` for eval")
    for p in (up, down, status, env):
        p.add_argument(
            "--dir",
            type=Path,
            default=None,
            help=f"cluster dir (default: ${LOCAL_SLURM_DIR_VAR} or ~/.local/state/hpc-ddp/slurm)",
        )


def run(args: argparse.Namespace) -> int:
    root = (args.dir or default_state_dir()).absolute()
    return {"up": _up, "down": _down, "status": _status, "env": _env}[args.action](root, args)


def _up(root: Path, args: argparse.Namespace) -> int:
    with dir_lock(root, args.timeout + 30):
        cluster = LocalCluster(root, args.nodes, args.cpus_per_node, args.gpus_per_node, args.port)
        if cluster.is_running():
            print(f"already running in {root}: {_describe(cluster)}")
            return 0
        started = time.monotonic()
        cluster.start(args.timeout)
        took = time.monotonic() - started
    print(f"local Slurm cluster up in {took:.2f} s: {_describe(cluster)}")
    print(f'use it with:  eval "$(hpc-ddp cluster env{_dir_flag(args)})"')
    return 0


def _down(root: Path, args: argparse.Namespace) -> int:
    with dir_lock(root):
        existed = root.exists()
        LocalCluster(root).stop()  # also when root is gone: its daemons or hosts line may not be
    print(f"stopped the local cluster in {root}" if existed else f"no local cluster in {root}")
    return 0


def _status(root: Path, args: argparse.Namespace) -> int:
    cluster = LocalCluster(root)
    if not cluster.is_running():
        print(f"not running ({root})")
        return 1
    print(f"running in {root}: {_describe(cluster)}")
    print(cluster.client().run(["sinfo", "-N"], check=False).stdout.rstrip())
    return 0


def _env(root: Path, args: argparse.Namespace) -> int:
    cluster = LocalCluster(root)
    if not cluster.is_running():
        raise HpcDdpError(f"no local cluster running in {root}", hint="hpc-ddp cluster up")
    for key, value in cluster.env().items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def _describe(cluster: LocalCluster) -> str:
    cfg = cluster.config
    gpus = f", {cfg.gpus_per_node} fake GPU(s) each" if cfg.gpus_per_node else ""
    return (
        f"{cfg.nodes} node(s) {cfg.nodelist} with {cfg.cpus_per_node} CPUs{gpus}; "
        f"slurmctld on {NODE_ADDR}:{cfg.ctld_port}, SLURM_CONF={cfg.conf_path}; "
        "only root can use it (munge)"
    )


def _dir_flag(args: argparse.Namespace) -> str:
    return f" --dir {shlex.quote(str(args.dir))}" if args.dir else ""
