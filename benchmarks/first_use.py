"""CUDA's first use, op by op: what epoch 1 of a captured LeNet run pays beyond later epochs.

    PYTHONPATH=$PWD python3 benchmarks/first_use.py [--model lenet] [--json OUT.json] [--cpu]
        [--warm-kernels] [--nproc N [--warm-allreduce] [--port P]]

In one fresh process on one GPU (no process group), in the trainer's order: the data's
normalisation and batch gathers, the captured step (three eager warm-up steps, the capture, the
first replays), the step's bookkeeping (the loss's float64 copy, the sync point's stack and
cat, the scheduler's fill), then one evaluation's ops (forward in eval mode, loss, argmax,
comparison, sums, the totals' vector). Each op runs twice, synchronised: the first call's excess
over the second is CUDA loading that op's kernels. ``--cpu`` checks the plumbing on a machine
without a GPU (its figures mean nothing).

``--nproc N``: N fresh processes, one GPU each, join NCCL and finish one all-reduce first (what
the start-up floor does), then run the same ops; the step's gradient all-reduces now run inside
it, and rank 0 reports. ``--warm-allreduce`` runs one all-reduce at the gradients' size before
the step, as its own row: whether the first step's extra time on several GPUs is that
collective's first run or the processes loading kernels side by side (on 4 x H200 it was not:
the gradients' first all-reduce took 0.46 ms). ``--warm-kernels`` runs the trainer's CUDA warm-up
(hpc_ddp/train/fast/kernel_warmup.py) on a thread beside the join, as ``train()`` does: what of the
first use it takes off the step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpc_ddp.runtime.evaluation import EvalSums, batch_terms, totals
from hpc_ddp.train.cifar.models import build_model
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast.gpu_data import normalize
from hpc_ddp.train.fast.kernel_warmup import KernelWarmup, optimizer_factory
from hpc_ddp.train.optim import build_optimizer

# The reference workload's optimizer (benchmarks/README.md): AdamW, 1e-3, no weight decay.
WORKLOAD = TrainConfig(optimizer="adam", lr=1e-3, weight_decay=0.0)


def timed(device: torch.device, fn: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()  # every rank starts the op together: a collective waits for none
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 1e3 * (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="lenet")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--eval-batch", type=int, default=256)
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--nproc", type=int, default=1, help="processes, one GPU each")
    parser.add_argument("--warm-allreduce", action="store_true")
    parser.add_argument(
        "--warm-kernels", action="store_true", help="the trainer's CUDA warm-up beside the join"
    )
    parser.add_argument("--port", type=int, default=29640, help="the ranks' rendezvous port")
    args = parser.parse_args()
    if args.nproc > 1:
        torch.multiprocessing.spawn(measure, args=(args,), nprocs=args.nproc)
    else:
        measure(0, args)


def start_warmup(dev: torch.device) -> KernelWarmup:
    """The trainer's warm-up thread, as ``train()`` starts it beside the process group."""
    make = optimizer_factory(WORKLOAD, captured=dev.type == "cuda")
    return KernelWarmup([dev], make, None).launch()


def join(rank: int, dev: torch.device, args: argparse.Namespace) -> None:
    """With ``--nproc``: the process group joined and one all-reduce done."""
    if args.nproc > 1:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # makes the context: one process alone times it apart
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        backend, device_id = ("gloo", None) if args.cpu else ("nccl", dev)
        dist.init_process_group(backend, rank=rank, world_size=args.nproc, device_id=device_id)
        dist.all_reduce(torch.ones(1, device=dev))


def measure(rank: int, args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    dev = torch.device("cpu") if args.cpu else torch.device("cuda", rank)
    warmup = start_warmup(dev) if args.warm_kernels else None
    join(rank, dev, args)
    if warmup is not None:
        warmup.finish()
    join_ms = 1e3 * (time.perf_counter() - t0)  # with --nproc: the context, NCCL, one all-reduce
    rows: list[tuple[str, float, float]] = []

    def op(name: str, fn: Callable[[], object]) -> None:
        rows.append((name, timed(dev, fn), timed(dev, fn)))

    context_ms = timed(dev, lambda: torch.zeros(1, device=dev))
    raw = torch.randint(0, 256, (4096, 3, 32, 32), dtype=torch.uint8, device=dev)
    images: list[torch.Tensor] = []
    op(
        "data: normalize (uint8 -> float32, divide, subtract)",
        lambda: images.append(normalize(raw)),
    )
    labels = torch.randint(0, 100, (4096,), device=dev)
    sel = torch.arange(args.batch, device=dev)
    op("data: index_select float32", lambda: images[0].index_select(0, sel))
    op("data: index_select int64", lambda: labels.index_select(0, sel))
    x, y = images[0].index_select(0, sel), labels.index_select(0, sel)

    torch.manual_seed(0)
    net = build_model(args.model, 100).to(dev)
    # the trainer's AdamW: torch's own would import torch._dynamo here
    opt = build_optimizer(WORKLOAD, net.parameters())
    if args.warm_allreduce and dist.is_initialized():
        flat = torch.zeros(sum(p.numel() for p in net.parameters()), device=dev)
        op("collective: all-reduce at the gradients' size", lambda: dist.all_reduce(flat))
    if dev.type == "cuda":
        from hpc_ddp.train.fast.cuda_graphs import GraphedStep

        step = GraphedStep(net, opt)
        for i in range(step.warmup + 2):  # eager warm-up steps, the capture, the first replays
            what = (
                "eager" if i < step.warmup else "capture + replay" if i == step.warmup else "replay"
            )
            rows.append((f"step {i + 1} ({what})", timed(dev, lambda: step.step(x, y)), 0.0))
        loss = step.loss
    else:
        loss = F.cross_entropy(net(x), y, reduction="sum")
    lr = torch.tensor(1e-3, device=dev)
    op("bookkeeping: loss float64 copy", lambda: loss.double())
    losses = [loss.double() for _ in range(4)]
    op("bookkeeping: stack float64", lambda: torch.stack(losses))
    host = torch.tensor([64.0, 0.0, 1.0], dtype=torch.float64)
    op("bookkeeping: cat with host values", lambda: torch.cat([torch.stack(losses), host.to(dev)]))
    op("bookkeeping: scheduler fill", lambda: lr.fill_(1e-3))

    ex = images[0][: args.eval_batch]
    ey = labels[: args.eval_batch]
    net.eval()
    with torch.no_grad():
        op("eval: forward at the eval batch", lambda: net(ex))
        op("eval: loss and correct (batch_terms)", lambda: batch_terms(net, ex, ey, None))
        sums = EvalSums.zeros(dev)
        op("eval: running sums (+=)", lambda: sums.add_batch(net, ex, ey, None))
        sums.count = len(ey)
        op("eval: totals vector", lambda: totals(sums, rank, args.nproc))
    report = {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "processes": args.nproc,
        "warm_allreduce": args.warm_allreduce,
        "warm_kernels": args.warm_kernels,
        "join_ms": join_ms,
        "context_ms": context_ms,
        "ops": [{"op": n, "first_ms": a, "second_ms": b} for n, a, b in rows],
        "seconds": time.perf_counter() - t0,
    }
    if rank == 0:
        print_report(report, rows, args.json)
    if dist.is_initialized():
        if dev.type == "cuda":
            step.release()  # captured NCCL work goes before its communicator, or teardown hangs
        dist.barrier()
        dist.destroy_process_group()


def print_report(report: dict, rows: list[tuple[str, float, float]], json_path: str | None) -> None:
    print(
        f"{report['device']} x {report['processes']}: join {report['join_ms']:.1f} ms, "
        f"context {report['context_ms']:.1f} ms"
    )
    print("| op | first call ms | second call ms |\n|---|---|---|")
    for name, first, second in rows:
        print(f"| {name} | {first:.2f} | {second:.2f} |")
    extra = sum(max(a - b, 0.0) for n, a, b in rows if not n.startswith("step "))
    print(f"first use outside the step: {extra:.1f} ms")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
