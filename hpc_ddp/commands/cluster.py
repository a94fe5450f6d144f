"""``hpc-ddp cluster up|down|status|env``: the embedded local Slurm cluster (the work is
hpc_ddp.localslurm.lifecycle's, which the Python API shares; this prints it)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from hpc_ddp import schema
from hpc_ddp.env_vars import LOCAL_SLURM_DIR_VAR
from hpc_ddp.localslurm import LocalCluster, lifecycle
from hpc_ddp.localslurm.config import NODE_ADDR, ClusterConfig
from hpc_ddp.localslurm.gpus import AUTO

START_TIMEOUT_S = schema.Range(0, 3600, above=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start the cluster (or keep the one already running)")
    up.add_argument("--nodes", type=_shape("nodes"), default=2, help="slurmd 'nodes' (default 2)")
    up.add_argument(
        "--cpus-per-node", type=_shape("cpus_per_node"), default=4, help="CPUs declared per node"
    )
    up.add_argument(
        "--gpus-per-node",
        type=_shape("gpus_per_node"),
        default=None,
        help="GPUs per node (gres): fake ones (default 0), or with --gpu-devices the real "
        "devices' share of each node (default: all of them, split equally)",
    )
    up.add_argument(
        "--gpu-devices",
        metavar=f"{AUTO}|FILE,...",
        default=None,
        help=f"real GPUs instead of fake ones: {AUTO} (every /dev/nvidiaN) or device files, "
        "shared out to the nodes in order",
    )
    up.add_argument(
        "--slurm-root",
        type=Path,
        default=None,
        metavar="DIR",
        help="use Debian's Slurm and munge packages unpacked under DIR (dpkg -x) instead of "
        "the installed ones: programs, plugins and libraries from there",
    )
    up.add_argument(
        "--cgroups",
        action="store_true",
        help="cgroup plugins: each task confined to its GPUs and bound to its CPUs",
    )
    up.add_argument(
        "--port",
        type=_shape("ctld_port"),
        default=None,
        help="slurmctld port (default: a free one)",
    )
    up.add_argument(
        "--timeout",
        type=schema.number_type(float, START_TIMEOUT_S),
        default=30,
        help="seconds to wait for idle nodes",
    )
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


def _shape(name: str) -> schema.NumberArg:
    """The argparse type of a cluster's number: its ClusterConfig field's Range."""
    return schema.flag_type(ClusterConfig, name)


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status, "env": _env}[args.action](args)


def _up(args: argparse.Namespace) -> int:
    up = lifecycle.cluster_up(
        args.dir,
        nodes=args.nodes,
        cpus_per_node=args.cpus_per_node,
        gpus_per_node=args.gpus_per_node,
        gpu_devices=args.gpu_devices,
        port=args.port,
        slurm_root=args.slurm_root,
        cgroups=args.cgroups,
        timeout_s=args.timeout,
    )
    if up.start_s is None:
        print(f"already running in {up.cluster.root}: {_describe(up.cluster)}")
        return 0
    print(f"local Slurm cluster up in {up.start_s:.2f} s: {_describe(up.cluster)}")
    print(f'use it with:  eval "$(hpc-ddp cluster env{_dir_flag(args)})"')
    return 0


def _down(args: argparse.Namespace) -> int:
    root = lifecycle.cluster_root(args.dir)
    existed = lifecycle.cluster_down(root)
    print(f"stopped the local cluster in {root}" if existed else f"no local cluster in {root}")
    return 0


def _status(args: argparse.Namespace) -> int:
    root = lifecycle.cluster_root(args.dir)
    cluster = lifecycle.running_cluster(root)
    if cluster is None:
        print(f"not running ({root})")
        return 1
    print(f"running in {root}: {_describe(cluster)}")
    print(cluster.client().run(["sinfo", "-N"], check=False).stdout.rstrip())
    return 0


def _env(args: argparse.Namespace) -> int:
    print(lifecycle.cluster_env_script(args.dir))
    return 0


def _describe(cluster: LocalCluster) -> str:
    cfg = cluster.config
    kind = "real" if cfg.real_gpus else "fake"
    gpus = f", {cfg.gpus_per_node} {kind} GPU(s) each" if cfg.gpus_per_node else ""
    extras = [f"Slurm from {cfg.slurm_root}"] if cfg.slurm_root else []
    extras += ["cgroups"] if cfg.cgroups else []
    return (
        f"{cfg.nodes} node(s) {cfg.nodelist} with {cfg.cpus_per_node} CPUs{gpus}; "
        f"slurmctld on {NODE_ADDR}:{cfg.ctld_port}, SLURM_CONF={cfg.conf_path}; "
        "only root can use it (munge)" + "".join(f"; {e}" for e in extras)
    )


def _dir_flag(args: argparse.Namespace) -> str:
    return f" --dir {shlex.quote(str(args.dir))}" if args.dir else ""
