"""One rank of a tiny job for the hpc_ddp.dist tests: init, all-reduce, then a chosen ending.

--mode ok:     all-reduce rank+1, print the sum, return 0
--mode raise:  rank 1 raises RuntimeError after init; the others block in an all-reduce
--mode usage:  raise a ConfigError before init (exit 2, HINT printed)
An atexit handler prints a marker: run_main leaves through os._exit, so it must never run
(the C++ destructors that abort Gloo processes at exit run at the same point as atexit).
"""

from __future__ import annotations

import argparse
import atexit

import torch
import torch.distributed as dist

from hpc_ddp.dist import init_distributed, run_main
from hpc_ddp.errors import ConfigError


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ok", "raise", "usage"], default="ok")
    parser.add_argument("--connect-timeout-s", type=float, default=60)
    args = parser.parse_args()
    atexit.register(lambda: print("ATEXIT-RAN", flush=True))
    if args.mode == "usage":
        raise ConfigError("--mode usage was asked for", hint="this is what a hint looks like")
    ctx = init_distributed(connect_timeout_s=args.connect_timeout_s, timeout_s=60)
    if args.mode == "raise" and ctx.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    value = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(value)
    print(f"rank {ctx.rank} sum {value.item():g} backend {ctx.backend}", flush=True)
    return 0


if __name__ == "__main__":
    run_main(main)
