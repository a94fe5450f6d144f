"""The project's own launchers: HPC_DDP_* variables per process.

``hpc-ddp launch pdsh|clush`` across hosts, and ``hpc-ddp train --nproc-per-node N`` forking one
node's workers (hpc_ddp.spawn).

Rank = node_rank * local_world_size + local_rank: every node runs the same number of processes.
"""

from __future__ import annotations

from collections.abc import Mapping

from hpc_ddp.cluster._vars import first_job_id, get_address, get_int, get_opt_int
from hpc_ddp.cluster.distenv import DistEnv
from hpc_ddp.cluster.master_port import parse_port
from hpc_ddp.errors import LaunchEnvError

LAUNCHERS = ("pdsh", "clush", "spawn")


def detect(environ: Mapping[str, str]) -> bool:
    return "HPC_DDP_LAUNCHER" in environ


def read(environ: Mapping[str, str], *, gpus_per_process: int) -> DistEnv:
    launcher = environ["HPC_DDP_LAUNCHER"]
    if launcher not in LAUNCHERS:
        raise LaunchEnvError(
            f"HPC_DDP_LAUNCHER={launcher!r} is not a known launcher "
            f"(valid: {', '.join(LAUNCHERS)})",
            hint="start jobs with `hpc-ddp launch`, which sets it, or unset HPC_DDP_LAUNCHER",
        )
    node_rank = get_int(environ, "HPC_DDP_NODE_RANK")
    num_nodes = get_int(environ, "HPC_DDP_NUM_NODES", minimum=1)
    local_rank = get_opt_int(environ, "HPC_DDP_LOCAL_RANK") or 0
    local_world = get_opt_int(environ, "HPC_DDP_LOCAL_WORLD_SIZE", minimum=1) or 1
    addr = get_address(environ, "HPC_DDP_MASTER_ADDR")
    if addr is None:
        raise LaunchEnvError(
            f"HPC_DDP_LAUNCHER={launcher} but HPC_DDP_MASTER_ADDR is not set",
            hint="the launch command must export HPC_DDP_MASTER_ADDR=<first host of -w>",
        )
    port_name = "HPC_DDP_MASTER_PORT" if environ.get("HPC_DDP_MASTER_PORT") else "MASTER_PORT"
    port_text = environ.get(port_name)
    if port_text is None:
        raise LaunchEnvError(
            f"HPC_DDP_LAUNCHER={launcher} but neither HPC_DDP_MASTER_PORT nor MASTER_PORT is set",
            hint="the launch command must export HPC_DDP_MASTER_PORT (the same on every host)",
        )
    port = parse_port(port_text, port_name)
    if "MASTER_PORT" in environ and parse_port(environ["MASTER_PORT"]) != port:
        raise LaunchEnvError(
            f"HPC_DDP_MASTER_PORT={port} and MASTER_PORT={environ['MASTER_PORT']} disagree",
            hint="set only one of them (hpc-ddp launch sets HPC_DDP_MASTER_PORT)",
        )
    return DistEnv(
        source=launcher,
        rank=node_rank * local_world + local_rank,
        local_rank=local_rank,
        world_size=num_nodes * local_world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        job_id=first_job_id(environ, ("HPC_DDP_JOB_ID",)),
        gpus_per_process=gpus_per_process,
        master_port_origin=port_name,
    )
