"""``hpc-ddp cluster up|down|status|env``: the embedded local Slurm cluster."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from hpc_ddp.env_vars import LOCAL_SLURM_DIR_VAR
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm import LocalCluster
from hpc_ddp.localslurm.config import NODE_ADDR
from hpc_ddp.localslurm.embedded import default_state_dir, dir_lock
from hpc_ddp.localslurm.gpus import AUTO, parse_devices, per_node


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = sub.add_parser("up", help="start the cluster (or keep the one already running)")
    up.add_argument("--nodes", type=int, default=2, help="slurmd 'nodes' (default 2)")
    up.add_argument("--cpus-per-node", type=int, default=4, help="CPUs declared per node")
    up.add_argument(
        "--gpus-per-node",
        type=int,
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
        real_gpus, gpus_per_node = _gpus(args)
        cluster = LocalCluster(
            root,
            args.nodes,
            args.cpus_per_node,
            gpus_per_node,
            args.port,
            slurm_root=args.slurm_root.absolute() if args.slurm_root else None,
            real_gpus=real_gpus,
            cgroups=args.cgroups,
        )
        if cluster.is_running():
            print(f"already running in {root}: {_describe(cluster)}")
            return 0
        started = time.monotonic()
        cluster.start(args.timeout)
        took = time.monotonic() - started
    print(f"local Slurm cluster up in {took:.2f} s: {_describe(cluster)}")
    print(f'use it with:  eval "$(hpc-ddp cluster env{_dir_flag(args)})"')
    return 0


def _gpus(args: argparse.Namespace) -> tuple[tuple[str, ...], int]:
    """(real GPU device files, GPUs per node) from --gpu-devices and --gpus-per-node."""
    if args.gpu_devices is None:
        return (), args.gpus_per_node or 0
    devices = parse_devices(args.gpu_devices)
    share = len(per_node(devices, args.nodes)[0])
    if args.gpus_per_node not in (None, share):
        raise ConfigError(
            f"--gpus-per-node {args.gpus_per_node} but --gpu-devices gives each of the "
            f"{args.nodes} node(s) {share}",
            hint="leave --gpus-per-node out with --gpu-devices",
        )
    return devices, share


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
    print(f"export SLURM_CONF={shlex.quote(str(cluster.conf_path))}")
    # An unpacked Slurm's dirs go in front of what the shell that evals this already has.
    for key, prefix in cluster.install.shell_exports():
        print(f'export {key}={shlex.quote(prefix)}"${{{key}:+:${key}}}"')
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
