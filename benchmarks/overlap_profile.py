"""What the gradient all-reduce costs the trainer's captured step on several GPUs, and what
would cut it, measured within one process group:

    torchrun --standalone --nproc-per-node=2 benchmarks/overlap_profile.py --json out.json
    NCCL_MAX_NCHANNELS=4 torchrun ... --tag ch4      # an NCCL setting: a launch of its own

The step is the default command's (``hpc-ddp train``): ``hpc_ddp.speed_up`` (channels_last,
fused SGD) and ``hpc_ddp.CapturedStep`` under bf16, batch ``--batch`` a GPU, random data already
on the GPU, so only the step and its all-reduce are timed. Each variant builds a fresh model and
step, replays it ``--steps`` times between CUDA events, three rounds, and reports the slowest
rank's median GPU ms a step:

- ``none``: no all-reduce at all (``torch.distributed.all_reduce`` made a no-op): the floor of a
  step on busy GPUs, what perfect scaling would run;
- ``buckets``: the trainer's buckets (``grad_buckets``: 1 MiB first, then 25 MiB), overlapped
  with backward;
- ``tail``: the same, with the first layers' last ``--tail-mib`` MiB cut into a bucket of their
  own, so less is left to reduce once backward ends;
- ``after``: one all-reduce of the whole gradient after backward, nothing overlapped;
- ``bf16``: the trainer's buckets sent in bf16 (half the bytes; not the trainer's arithmetic,
  which sums in fp32);
- ``small``: 8 MiB buckets.

``--high-priority`` gives NCCL a high-priority stream (``ProcessGroupNCCL.Options``), so its
kernels are scheduled ahead of backward's. Rank 0 prints ``OVERLAP {json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import hpc_ddp
from hpc_ddp.runtime import captured_step, grad_buckets

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
VARIANTS = ("none", "buckets", "tail", "after", "bf16", "small")  # the module docstring's list


@contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


class _Done:
    """What ``all_reduce(async_op=True)`` returns for an all-reduce that does nothing."""

    def wait(self) -> bool:
        return True


class _CopyBack:
    """A bf16 all-reduce's work: waiting for it also copies the sum back into the fp32 bucket,
    so the copy runs where ``BucketedAllReduce.finish`` waits, not during backward."""

    def __init__(self, work: dist.Work, bucket: torch.Tensor, half: torch.Tensor) -> None:
        self.work, self.bucket, self.half = work, bucket, half

    def wait(self) -> bool:
        self.work.wait()
        self.bucket.copy_(self.half)
        return True


def _no_allreduce(tensor: torch.Tensor, *args: object, async_op: bool = False, **kw: object):
    return _Done() if async_op else None


def _bf16_allreduce(real: Callable) -> Callable:
    def reduce(tensor: torch.Tensor, *args: object, async_op: bool = False, **kw: object):
        if tensor.dtype != torch.float32:
            return real(tensor, *args, async_op=async_op, **kw)
        half = tensor.to(torch.bfloat16)
        done = _CopyBack(real(half, *args, async_op=True, **kw), tensor, half)
        return done if async_op else done.wait() and None

    return reduce


def _tail_bounds(tail_bytes: int) -> Callable:
    """``bucket_bounds`` with the buffer's last ``tail_bytes`` or more (the first layers, whose
    gradients come last) in a bucket of their own."""
    real = grad_buckets.bucket_bounds

    def bounds(numels, element_size, *args: object, **kw: object) -> list[tuple[int, int]]:
        cut, size = len(numels), 0
        while cut > 1 and size < tail_bytes:
            cut -= 1
            size += numels[cut] * element_size
        return [*real(numels[:cut], element_size, *args, **kw), (cut, len(numels))]

    return bounds


def _sized(first: int, rest: int) -> Callable:
    """The class ``CapturedStep`` builds its buckets with, with other sizes."""
    return partial(grad_buckets.BucketedAllReduce, first_bytes=first, bytes_per_bucket=rest)


def _variant(name: str, tail_mib: float) -> list[tuple[object, str, object]]:
    """(owner, attribute, replacement) for each patch a variant needs."""
    real = dist.all_reduce
    return {
        "none": [(dist, "all_reduce", _no_allreduce)],
        "buckets": [],
        "tail": [(grad_buckets, "bucket_bounds", _tail_bounds(int(tail_mib * MIB)))],
        "after": [(captured_step, "BucketedAllReduce", _sized(1 << 40, 1 << 40))],
        "bf16": [(dist, "all_reduce", _bf16_allreduce(real))],
        "small": [(captured_step, "BucketedAllReduce", _sized(MIB, 8 * MIB))],
    }[name]


def _model(name: str, classes: int) -> torch.nn.Module:
    from hpc_ddp.train import registry

    return registry.resolve("model", str(REPO / name) if ":" in name else name)(classes)


def _step_ms(
    args: argparse.Namespace, variant: str, dev: torch.device
) -> tuple[list[float], list[float], dict[str, float] | None]:
    """(GPU ms a step per round, the buckets' MiB in reduce order, the trace's split or None) of
    a fresh model and captured step under ``variant``."""
    patches = _variant(variant, args.tail_mib)
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size, device=dev)
    y = torch.randint(0, args.classes, (args.batch,), device=dev)
    net = _model(args.model, args.classes).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    net, opt = hpc_ddp.speed_up(net, opt, log=lambda _line: None)
    x = x.contiguous(memory_format=torch.channels_last)
    with ExitStack() as patched:
        for owner, name, value in patches:
            patched.enter_context(_patched(owner, name, value))
        step = hpc_ddp.CapturedStep(net, opt, amp_dtype=torch.bfloat16, log=lambda _line: None)
        for _ in range(args.warmup):
            step(x, y)
        rounds = [_timed(lambda: step(x, y), args.steps, dev) for _ in range(3)]
        split = None
        if args.trace and variant == "buckets":
            path = f"{args.trace}.rank{dist.get_rank()}.json"
            _trace(lambda: step(x, y), path)
            split = trace_split(path)
        buckets = step.buckets
        mib = [] if buckets is None else _bucket_mib(buckets)
        step.close()
    return rounds, mib, split


def _trace(step: Callable[[], object], path: str) -> None:
    """A kernel trace of 5 steps (torch.profiler, Chrome's format): where NCCL's kernels run
    beside backward's, and what is left after it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _overlap(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> float:
    """The time both unions cover."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total


def trace_split(path: str, steps: int = 5) -> dict[str, float]:
    """ms a step, from a kernel trace: the span, NCCL's kernels (all, and where no other kernel
    runs: exposed), the other kernels' busy time, and the GPU idle."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    nccl = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    rest = _union(
        [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    )
    every = _union(nccl + rest)
    span = every[-1][1] - every[0][0] if every else 0.0
    per_step = 1e-3 / steps  # trace times are in microseconds
    return {
        "span": span * per_step,
        "nccl": _length(nccl) * per_step,
        "nccl_exposed": (_length(nccl) - _overlap(nccl, rest)) * per_step,
        "compute": _length(rest) * per_step,
        "idle": (span - _length(every)) * per_step,
    }


def _bucket_mib(buckets: grad_buckets.BucketedAllReduce) -> list[float]:
    """Each bucket's size in MiB, in the order they are reduced."""
    size = buckets.flat.element_size()
    return [sum(p.numel() for p in buckets.params[a:b]) * size / MIB for a, b in buckets.bounds]


def _timed(step: Callable[[], object], steps: int, dev: torch.device) -> float:
    """ms a step over ``steps`` steps: GPU time between CUDA events (the host never waits in
    between), or the host's clock on a CPU."""
    if dev.type == "cpu":
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        return 1e3 * (time.perf_counter() - t0) / steps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet18", help="a built-in or FILE.py:FUNCTION")
    p.add_argument("--size", type=int, default=32, help="the input's side in pixels")
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch", type=int, default=256, help="per GPU")
    p.add_argument("--steps", type=int, default=100, help="replays a round")
    p.add_argument("--warmup", type=int, default=30, help="steps before the rounds")
    p.add_argument("--tail-mib", type=float, default=1.0)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated")
    p.add_argument("--high-priority", action="store_true", help="NCCL on a high-priority stream")
    p.add_argument("--tag", default="", help="a label for this launch (its NCCL settings)")
    p.add_argument("--json", help="append the record here (rank 0)")
    p.add_argument("--trace", help="buckets: write PATH.rankN.json, a kernel trace of 5 steps")
    p.add_argument("--cpu", action="store_true", help="Gloo on the CPU: a check, not a figure")
    args = p.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; choose from {','.join(VARIANTS)}")
    if args.cpu and args.trace:
        p.error("--trace records CUDA kernels: leave it out with --cpu")
    if args.cpu:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    else:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(dev)
        options = None
        if args.high_priority:
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = True
        dist.init_process_group("nccl", device_id=dev, pg_options=options)
    world = dist.get_world_size()
    record = {
        "model": args.model, "size": args.size, "batch": args.batch, "gpus": world,
        "gpu": "cpu" if args.cpu else torch.cuda.get_device_name(dev), "tag": args.tag,
        "high_priority": args.high_priority, "ms": {}, "bucket_mib": {},
        "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }  # fmt: skip
    for variant in args.variants.split(","):
        ms, mib, split = _step_ms(args, variant, dev)
        if split is not None:
            record["trace_ms"] = {k: round(v, 4) for k, v in split.items()}
        record["bucket_mib"][variant] = [round(m, 2) for m in mib]
        rounds = torch.tensor(ms, device=dev)
        slowest = [torch.zeros_like(rounds) for _ in range(world)]
        dist.all_gather(slowest, rounds)
        per_round = torch.stack(slowest).max(0).values.tolist()
        record["ms"][variant] = round(statistics.median(per_round), 4)
    if dist.get_rank() == 0:
        print("OVERLAP " + json.dumps(record), flush=True)
        if args.json:
            with open(args.json, "a") as fh:
                fh.write(json.dumps(record) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
