"""``hpc-ddp env``: show the distributed environment this process was launched into.

Answers in well under a second: reads variables and /proc, /sys only; never imports torch.
"CUDA available" here means an NVIDIA driver is loaded and at least one GPU is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

from hpc_ddp import schema
from hpc_ddp.cluster import detect_env
from hpc_ddp.cluster.devices import has_nvidia_driver
from hpc_ddp.env_vars import GPUS_PER_PROCESS_VAR
from hpc_ddp.network import choose_backend


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--gpus-per-process",
        type=schema.number_type(int, schema.Range(0, schema.MAX_PER_NODE)),
        default=None,
        metavar="N",
        help=f"GPUs each process drives (default or 0: ${GPUS_PER_PROCESS_VAR}, else 1)",
    )
    parser.add_argument(
        "--backend",
        default=None,
        choices=("auto", "nccl", "gloo", "mpi"),
        help="backend you intend to request (default: auto)",
    )


def collect(args: argparse.Namespace, proc_root: str = "/proc", sys_root: str = "/") -> dict:
    driver = has_nvidia_driver(proc_root)
    # Without a driver, devices listed in CUDA_VISIBLE_DEVICES cannot be used: report CPU.
    env = detect_env(
        gpus_per_process=schema.gpus_per_process_setting(
            args.gpus_per_process, "--gpus-per-process"
        ),
        visible_gpus=None if driver else 0,
        proc_root=proc_root,
    )
    cuda = driver and bool(env.gpus)
    choice = choose_backend(
        cuda_available=cuda,
        requested=args.backend,
        sys_root=sys_root,
        env=env,
    )
    data: dict[str, Any] = env.to_json()
    data.update(
        hostname=socket.gethostname(),
        backend=choice.backend,
        backend_reason=choice.reason,
        interconnect=choice.interconnect,
        interface=choice.interface,
        devices=[f"cuda:{i}" for i in env.gpus] if cuda else ["cpu"],
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        backend_env=choice.env,
    )
    return data


_ROWS = (
    ("source", "launcher"),
    ("hostname", "host"),
    ("job_id", "job id"),
    ("rank", "rank"),
    ("local_rank", "local rank"),
    ("world_size", "world size"),
    ("local_world_size", "local world size"),
    ("node_rank", "node rank"),
    ("num_nodes", "nodes"),
    ("master_addr", "master addr"),
    ("master_port", "master port"),
    ("layout", "layout"),
    ("devices", "devices"),
    ("cuda_visible_devices", "CUDA_VISIBLE_DEVICES"),
    ("backend", "backend"),
    ("interconnect", "interconnect"),
    ("interface", "interface"),
    ("backend_reason", "why"),
)


def format_table(data: dict) -> str:
    width = max(len(label) for _, label in _ROWS)
    lines = []
    for key, label in _ROWS:
        value = data.get(key)
        if isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        lines.append(f"{label:<{width}}  {'-' if value is None else value}")
    for key, value in sorted(data.get("backend_env", {}).items()):
        lines.append(f"{'suggested env':<{width}}  {key}={value}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    data = collect(args)
    text = json.dumps(data, sort_keys=True) if args.json else format_table(data)
    # One write with its newline: every rank of a job prints into the same pipe, and print()'s
    # separate newline write (unbuffered output) let two ranks' lines run into one.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0
