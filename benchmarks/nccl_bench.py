"""NCCL all-reduce ceiling on this machine: bus bandwidth per message size (torchrun, 1 proc/GPU).

Bus bandwidth follows nccl-tests: algbw = bytes / time, busbw = algbw * 2 (n - 1) / n, the rate
each link must carry for a ring all-reduce, comparable across GPU counts. The trainer's figure
(gradient bytes / all-reduce time inside training) is compared against this ceiling.

    torchrun --standalone --nproc-per-node=4 benchmarks/nccl_bench.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def bench(numel: int, dtype: torch.dtype, iters: int, warmup: int = 5) -> float:
    """Median seconds of one all-reduce of ``numel`` elements (CUDA events, many repeats)."""
    t = torch.randn(numel, device="cuda").to(dtype)
    for _ in range(warmup):
        dist.all_reduce(t)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(t)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    times.sort()
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--sizes-mib", default="0.25,1,4,16,44.7,64,256,1024")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    n = dist.get_world_size()
    rows = []
    for mib in (float(s) for s in args.sizes_mib.split(",")):
        nbytes = int(mib * 2**20) // 4 * 4
        sec = bench(nbytes // 4, torch.float32, iters=20 if mib > 100 else 50)
        algbw = nbytes / sec / 1e9
        rows.append(
            {"MiB": mib, "seconds": sec, "algbw_GBps": algbw, "busbw_GBps": algbw * 2 * (n - 1) / n}
        )
    if rank == 0:
        out = {
            "bench": "nccl_allreduce",
            "gpus": n,
            "gpu_name": torch.cuda.get_device_name(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "rows": rows,
        }
        print("NCCL_RESULT " + json.dumps(out), flush=True)
        for r in rows:
            print(
                f"{r['MiB']:>8} MiB {r['seconds'] * 1e6:9.1f} us busbw {r['busbw_GBps']:7.1f} GB/s"
            )
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
