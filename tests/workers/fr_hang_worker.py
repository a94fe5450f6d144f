"""One rank of a real hang for tests/test_flight_recorder.py: torch's flight recorder records
real Gloo collectives, one rank skips the last one, and every rank writes torch's own dump.

Each step all-reduces two "gradient buckets" on the default group (DDP issues one all-reduce
per bucket); after step ``--side-step`` every rank also all-reduces once on a second Gloo group,
as the checkpointer's background agreement does (sequence numbers count per group). Rank 0
reports each step in progress.json through the trainer's own writer. After ``--steps`` steps,
rank ``--lag-rank`` stops; the others enter the next step's first all-reduce, which can never
complete. It is started with ``async_op=True`` so they can still dump: on a GPU, torch's NCCL
watchdog thread writes the dump on timeout; Gloo has no such thread, so each rank writes the
bytes of ``_dump_fr_trace`` (the same pickle) to ``<TORCH_FR_DUMP_TEMP_FILE><rank>``, the file
name torch's dump-on-timeout uses. Every rank waits for all dumps before it leaves through
``run_main`` (a rank that left earlier would fail the others' pending all-reduce first).
"""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace

from hpc_ddp.dist import init_distributed, run_main
from hpc_ddp.run_dir.paths import FR_DUMP_FILE_VAR, RunPaths
from hpc_ddp.slurm_client import wait_for
from hpc_ddp.train.progress import Progress
from hpc_ddp.train.report import ProgressFile

BUCKETS = (1000, 10)  # elements per all-reduce of a step
DEADLINE_S = 30.0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--side-step", type=int, default=3)
    parser.add_argument("--lag-rank", type=int, default=1)
    parser.add_argument("--dump-before-hang", type=Path, help="also dump here, before the hang")
    args = parser.parse_args()
    ctx = init_distributed(connect_timeout_s=30, timeout_s=60)
    side = dist.new_group(backend="gloo")
    buckets = [torch.ones(n) for n in BUCKETS]
    for step in range(1, args.steps + 1):
        for bucket in buckets:
            dist.all_reduce(bucket)
        if step == args.side_step:
            dist.all_reduce(torch.ones(1), group=side)
        # A fresh writer per step: the trainer's throttles routine updates to one per 0.5 s.
        ProgressFile(RunPaths(args.run_dir), ctx.rank, ctx.world_size).write(
            Progress(global_step=step), "training"
        )
    # Every collective so far: init_distributed's own, the buckets', the side group's one.
    _wait_retired(1 + args.steps * len(BUCKETS) + (args.side_step <= args.steps))
    if args.dump_before_hang:
        _dump(f"{args.dump_before_hang}/rank_", ctx.rank, ctx.world_size)
    pending = None
    if ctx.rank != args.lag_rank:  # the next step's first all-reduce, which lag_rank skips
        pending = dist.all_reduce(buckets[0], async_op=True)
    _dump(os.environ[FR_DUMP_FILE_VAR], ctx.rank, ctx.world_size)
    del pending  # held until the dumps are written
    return 0


def _dump(prefix: str, rank: int, world_size: int) -> None:
    """Torch's dump bytes to ``<prefix><rank>``, then wait for every rank's file."""
    dump = Path(f"{prefix}{rank}")
    dump.parent.mkdir(parents=True, exist_ok=True)
    dump.write_bytes(_dump_fr_trace(True, True, False))  # what dump-on-timeout writes
    files = [Path(f"{prefix}{r}") for r in range(world_size)]
    wait_for(lambda: all(f.exists() for f in files), DEADLINE_S, "every rank's dump", 0.01)
    print(f"rank {rank} dumped {dump}", flush=True)


def _wait_retired(count: int) -> None:
    """Until torch has retired ``count`` entries: Gloo retires a collective on its worker
    thread, sometimes just after ``wait()`` returned; a real hang dumps minutes later."""

    def retired() -> bool:
        entries = pickle.loads(_dump_fr_trace(True, False, False))["entries"]
        return sum(bool(e.get("retired")) for e in entries) >= count

    wait_for(retired, DEADLINE_S, f"{count} retired collectives", interval_s=0.01)


if __name__ == "__main__":
    run_main(main)
