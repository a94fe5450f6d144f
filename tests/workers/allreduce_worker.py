"""One rank of a tiny Gloo all-reduce job, started by ``hpc-ddp launch`` (for the launch tests).

Reads its place from the launcher's variables (hpc_ddp.cluster.detect_env: torchrun's or the
HPC_DDP_* ones), joins the group through hpc_ddp.dist.init_distributed, all-reduces rank+1 and
writes ``<out>/rank-<rank>.json`` with what it saw, then leaves through shutdown_and_exit.

--fail-rank R: that rank exits 1 right after the all-reduce (a "rank that dies").
--hang-rank R: that rank writes its pid to ``<out>/hanging-<rank>`` and sleeps forever (for
SIGKILL / stop tests); the other ranks wait for it in an all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_ddp.dist import init_distributed, run_main


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--fail-rank", type=int, default=-1)
    p.add_argument("--hang-rank", type=int, default=-1)
    args = p.parse_args()

    ctx = init_distributed(connect_timeout_s=60, timeout_s=600)
    env = ctx.env
    value = torch.tensor([float(env.rank + 1)])
    dist.all_reduce(value)
    result = {
        "rank": env.rank,
        "world_size": env.world_size,
        "node_rank": env.node_rank,
        "local_rank": env.local_rank,
        "source": env.source,
        "master_addr": env.master_addr,
        "master_port": env.master_port,
        "sum": value.item(),
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{env.rank}.json").write_text(json.dumps(result))
    if env.rank == args.fail_rank:
        print(f"worker rank {env.rank}: failing on purpose", flush=True)
        return 1
    if args.hang_rank >= 0:
        if env.rank == args.hang_rank:
            (args.out / f"hanging-{env.rank}").write_text(str(os.getpid()))
            while True:  # killed from outside; never joins the all-reduce below
                time.sleep(1)
        # The other ranks block here until the hanging one dies (or a stop ends them).
        dist.all_reduce(torch.zeros(1))
    return 0


if __name__ == "__main__":
    run_main(main)
