"""The launch contract of :mod:`hpc_ddp.env_vars`, read back: a process the toolkit's own
starters (pdsh, clush, spawn) started.

``hpc-ddp launch pdsh|clush`` across hosts, and ``hpc-ddp train --nproc-per-node N`` forking one
node's workers (hpc_ddp.spawn).

Rank = node_rank * local_world_size + local_rank: every node runs the same number of processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from hpc_ddp.cluster._vars import first_job_id, get_address, get_int, get_opt_int
from hpc_ddp.cluster.distenv import DistEnv
from hpc_ddp.cluster.master_port import parse_port
from hpc_ddp.env_vars import (
    JOB_ID_VAR,
    LOCAL_RANK_VAR,
    LOCAL_WORLD_SIZE_VAR,
    MASTER_ADDR_VAR,
    MASTER_PORT_VAR,
    NODE_RANK_VAR,
    NUM_NODES_VAR,
    STARTED_BY_VAR,
    STARTERS,
    Starter,
)
from hpc_ddp.errors import LaunchEnvError


def detect(environ: Mapping[str, str]) -> bool:
    return STARTED_BY_VAR in environ


def _starter(environ: Mapping[str, str]) -> Starter:
    starter = environ[STARTED_BY_VAR]
    if starter in STARTERS:
        return cast(Starter, starter)
    raise LaunchEnvError(
        f"{STARTED_BY_VAR}={starter!r} is not a known starter (valid: {', '.join(STARTERS)})",
        hint=f"start jobs with `hpc-ddp launch`, which sets it, or unset {STARTED_BY_VAR}",
    )


def read(environ: Mapping[str, str], *, gpus_per_process: int) -> DistEnv:
    starter = _starter(environ)
    node_rank = get_int(environ, NODE_RANK_VAR)
    num_nodes = get_int(environ, NUM_NODES_VAR, minimum=1)
    local_rank = get_opt_int(environ, LOCAL_RANK_VAR) or 0
    local_world = get_opt_int(environ, LOCAL_WORLD_SIZE_VAR, minimum=1) or 1
    addr = get_address(environ, MASTER_ADDR_VAR)
    if addr is None:
        raise LaunchEnvError(
            f"{STARTED_BY_VAR}={starter} but {MASTER_ADDR_VAR} is not set",
            hint=f"the launch command must export {MASTER_ADDR_VAR}=<first host of -w>",
        )
    port_name = MASTER_PORT_VAR if environ.get(MASTER_PORT_VAR) else "MASTER_PORT"
    port_text = environ.get(port_name)
    if port_text is None:
        raise LaunchEnvError(
            f"{STARTED_BY_VAR}={starter} but neither {MASTER_PORT_VAR} nor MASTER_PORT is set",
            hint=f"the launch command must export {MASTER_PORT_VAR} (the same on every host)",
        )
    port = parse_port(port_text, port_name)
    if "MASTER_PORT" in environ and parse_port(environ["MASTER_PORT"]) != port:
        raise LaunchEnvError(
            f"{MASTER_PORT_VAR}={port} and MASTER_PORT={environ['MASTER_PORT']} disagree",
            hint=f"set only one of them (hpc-ddp launch sets {MASTER_PORT_VAR})",
        )
    return DistEnv(
        source=starter,
        rank=node_rank * local_world + local_rank,
        local_rank=local_rank,
        world_size=num_nodes * local_world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        job_id=first_job_id(environ, (JOB_ID_VAR,)),
        gpus_per_process=gpus_per_process,
        master_port_origin=port_name,
    )
