"""``python -m hpc_ddp.deploy.preflight``: every task says who it is, before training starts.

The sbatch templates run it as a first, cheap step (it imports no torch). Its lines in the job log
answer "which rank ran where and what did it see" after the fact, and a task whose launch
variables are wrong (srun forgotten, inconsistent counts, unresolvable master) fails here in
seconds with a HINT instead of hanging in the process-group rendezvous.
"""

from __future__ import annotations

import os
import socket
import sys

from hpc_ddp.cluster import detect_env
from hpc_ddp.env_vars import RDZV_ENDPOINT_VAR
from hpc_ddp.errors import HpcDdpError


def line(environ: dict[str, str] | None = None) -> str:
    env_vars = dict(os.environ if environ is None else environ)
    node = env_vars.get("SLURMD_NODENAME", "?")
    cvd = env_vars.get("CUDA_VISIBLE_DEVICES", "-")
    torchrun_agent = RDZV_ENDPOINT_VAR in env_vars and "TORCHELASTIC_RUN_ID" not in env_vars
    if torchrun_agent:  # torchrun layout, before torchrun: one task per node, ranks come later
        return (
            f"hpc-ddp preflight: torchrun agent node_rank={env_vars.get('SLURM_NODEID', '?')}"
            f"/{env_vars.get('SLURM_JOB_NUM_NODES', '?')} node={node} host={socket.gethostname()} "
            f"rdzv={env_vars[RDZV_ENDPOINT_VAR]} CUDA_VISIBLE_DEVICES={cvd}"
        )
    # GPUs as Slurm bound them (CUDA_VISIBLE_DEVICES): checks the binding, not the driver.
    try:
        d = detect_env(env_vars)
    except HpcDdpError as err:
        raise HpcDdpError(f"on {node}: {err.message}", hint=err.hint) from None
    try:
        addr = socket.gethostbyname(d.master_addr)
    except OSError as err:
        raise HpcDdpError(
            f"master address {d.master_addr!r} does not resolve on {node}: {err}",
            hint="the first host of the node list must resolve on every node (check /etc/hosts, "
            "DNS, or set MASTER_ADDR to an address)",
        ) from None
    return (
        f"hpc-ddp preflight: rank={d.rank}/{d.world_size} local_rank={d.local_rank}"
        f"/{d.local_world_size} node_rank={d.node_rank}/{d.num_nodes} node={node} "
        f"master={d.master_addr}:{d.master_port} ({addr}) source={d.source} "
        + _devices(d.gpus, d.gpus_per_process, cvd)
    )


def _devices(gpus: tuple[int, ...], gpus_per_process: int, cvd: str) -> str:
    """``device=CPU`` when no GPU is bound (a count of GPUs per process means nothing then);
    a CUDA_VISIBLE_DEVICES that is set anyway stays visible, as it explains why."""
    if not gpus:
        return "device=CPU" + (f" CUDA_VISIBLE_DEVICES={cvd}" if cvd != "-" else "")
    listed = ",".join(map(str, gpus))
    return f"gpus={listed} gpus_per_process={gpus_per_process} CUDA_VISIBLE_DEVICES={cvd}"


def main() -> int:
    try:
        # One write() per line: under `python -u` (torchrun's workers) print() issues the text
        # and the newline as two writes, and lines of processes sharing a pipe interleave.
        sys.stdout.write(line() + "\n")
        sys.stdout.flush()
    except HpcDdpError as err:
        print(f"hpc-ddp preflight FAILED on {socket.gethostname()}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
