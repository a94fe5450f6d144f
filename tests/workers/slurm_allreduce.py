"""One srun task of a Gloo all-reduce on the local Slurm cluster (tests/test_slurm_env.py).

Joins through hpc_ddp.dist.init_distributed (which reads the Slurm variables), all-reduces
rank+1, checks the sum, prints one JSON line and leaves through shutdown_and_exit.

--exit-rank R --exit-code C: rank R exits with C right after joining, without entering the
all-reduce that the other ranks then wait in: a crashed rank, for the no-hang test.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

from hpc_ddp.dist import init_distributed, shutdown_and_exit


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit-rank", type=int, default=-1)
    parser.add_argument("--exit-code", type=int, default=3)
    args = parser.parse_args()

    ctx = init_distributed(connect_timeout_s=30, timeout_s=120)
    env = ctx.env
    if env.rank == args.exit_rank:
        print(json.dumps({"rank": env.rank, "exiting": args.exit_code}), flush=True)
        os._exit(args.exit_code)  # a crash: no goodbye to the group
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    expected = env.world_size * (env.world_size + 1) / 2
    record = {
        "rank": env.rank,
        "world_size": env.world_size,
        "node_rank": env.node_rank,
        "master_addr": env.master_addr,
        "master_port": env.master_port,
        "backend": ctx.backend,
        "sum": value.item(),
        "expected": expected,
        "hostname": socket.gethostname(),
    }
    print(json.dumps(record), flush=True)
    if value.item() != expected:
        print(f"rank {env.rank}: sum {value.item()} != {expected}", file=sys.stderr, flush=True)
        shutdown_and_exit(1)
    shutdown_and_exit(0)


if __name__ == "__main__":
    main()
