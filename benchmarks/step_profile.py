"""Where a training step's time goes: eager DDP vs the captured step, with and without the
per-step host sync the trainer does (reading the loss), on random data already on the GPU.

    torchrun --standalone --nproc-per-node=4 benchmarks/step_profile.py --json out.json

Per variant: host wall time per step over ``--steps`` steps (synchronised at the end only, so
CPU launch work and GPU work overlap as they would in a loop that never waits), and for the
graph the GPU time of back-to-back replays (CUDA events): the floor a step can reach.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp.train.cifar.models import build_model
from hpc_ddp.train.fast.cuda_graphs import GraphedStep


def eager_step(model, opt, x, y, amp):
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
        out = model(x)
    loss = F.cross_entropy(out.float(), y, reduction="sum")
    (loss / y.shape[0]).backward()
    opt.step()
    return loss


def timed(fn, steps: int, sync_each: bool) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = fn()
        if sync_each:
            float(loss)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def profile(
    model_name: str, batch: int, amp, steps: int, dev: torch.device, variants: bool = False
) -> dict:
    torch.manual_seed(0)
    x = torch.randn(batch, 3, 32, 32, device=dev)
    y = torch.randint(0, 100, (batch,), device=dev)
    res: dict = {}
    net = build_model(model_name, 100).to(dev)
    ddp = DDP(net, device_ids=[dev])
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0, foreach=True)
    for sync in (False, True):
        key = f"eager_ddp{'_sync' if sync else ''}_ms"
        res[key] = 1e3 * timed(lambda: eager_step(ddp, opt, x, y, amp), steps, sync)
    net2 = build_model(model_name, 100).to(dev)
    graphed = GraphedStep(
        net2, torch.optim.AdamW(net2.parameters(), lr=1e-3, weight_decay=0), amp_dtype=amp
    )
    for sync in (False, True):
        key = f"graphed{'_sync' if sync else ''}_ms"
        res[key] = 1e3 * timed(lambda: graphed.step(x, y), steps, sync)
    g = graphed.graphs[0]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        g.replay()
    end.record()
    end.synchronize()
    res["graph_replay_gpu_ms"] = start.elapsed_time(end) / steps
    res["replays"] = graphed.replays
    graphed.release()  # before the process group goes (see GraphedStep.release)
    if variants:  # what fewer kernels would buy: fused Adam, autotuned cuDNN algorithms
        for name, fused, bench in (
            ("fused_adam", True, False),
            ("cudnn_benchmark", False, True),
            ("fused_adam_cudnn_benchmark", True, True),
        ):
            torch.backends.cudnn.benchmark = bench
            net3 = build_model(model_name, 100).to(dev)
            opt3 = torch.optim.AdamW(net3.parameters(), lr=1e-3, weight_decay=0, fused=fused)
            g3 = GraphedStep(net3, opt3, amp_dtype=amp)
            res[f"graphed_{name}_ms"] = 1e3 * timed(lambda g3=g3: g3.step(x, y), steps, False)
            g3.release()
        torch.backends.cudnn.benchmark = False
    return res


def kernel_table(path: str, dev: torch.device) -> None:
    """torch.profiler over 20 eager LeNet steps (no DDP): which kernels a step launches."""
    from torch.profiler import ProfilerActivity, profile

    net = build_model("lenet", 100).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0, capturable=True)
    x = torch.randn(64, 3, 32, 32, device=dev)
    y = torch.randint(0, 100, (64,), device=dev)
    for _ in range(5):
        eager_step(net, opt, x, y, None)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            eager_step(net, opt, x, y, None)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    with open(path, "w") as fh:
        fh.write(
            f"{len(events) / 20:.1f} GPU kernels/copies per step, "
            f"{sum(e.device_time for e in events) / 20:.1f} us of GPU time per step\n\n"
        )
        fh.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--variants", action="store_true", help="fused Adam, cuDNN autotuning")
    parser.add_argument("--lenet-only", action="store_true")
    parser.add_argument("--kernels", default=None, help="write a kernel table (profiler) here")
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    n = dist.get_world_size()
    out = {"gpus": n, "gpu_name": torch.cuda.get_device_name(dev)}
    out["lenet_b64_fp32"] = profile("lenet", 64, None, args.steps, dev, args.variants)
    if not args.lenet_only:
        out["resnet18_b256_bf16"] = profile("resnet18", 256, torch.bfloat16, 50, dev)
    if args.kernels and dist.get_rank() == 0:
        kernel_table(args.kernels, dev)
    if dist.get_rank() == 0:
        print("STEP_PROFILE " + json.dumps(out), flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
