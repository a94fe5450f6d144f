"""A complete DDP training script on hpc_ddp's public API (docs/your-code.md walks through it).

It trains a small MLP on a synthetic dataset of its own and runs unchanged wherever its processes
are started: torchrun, srun in a rendered sbatch, `hpc-ddp launch` (pdsh/clush), submitit or plain
`python` (one process). It resumes from its newest checkpoint to the same final weights as an
uninterrupted run; on SIGUSR1/SIGTERM it checkpoints, asks Slurm to requeue it and exits 75.

    torchrun --standalone --nproc-per-node 2 examples/ddp_train.py --epochs 3 --run-dir runs/ex
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset

import hpc_ddp


class Blobs(Dataset):
    """``n`` noisy points around 4 fixed centres in 16 dimensions; the label is the centre."""

    def __init__(self, n: int, seed: int) -> None:
        centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(4, (n,), generator=g)
        self.x = centres[self.y] + 1.5 * torch.randn(n, 16, generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="DDP training on hpc_ddp's public API")
    p.add_argument("--run-dir", type=Path, default=Path("runs/ddp_train"))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=4096, help="training samples (test: a quarter)")
    p.add_argument("--batch-size", type=int, default=32, help="per process and micro-batch")
    p.add_argument("--accum-steps", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps; 0: epoch ends only")
    p.add_argument("--fast", action="store_true", help="speed_up + CapturedStep: a faster GPU step")
    p.add_argument("--hold-at-step", type=int, default=0, help="tests: wait there for a signal")
    return p.parse_args()


def ddp_step(
    net: nn.Module, opt: torch.optim.Optimizer, accum_steps: int, ctx: hpc_ddp.DistContext
) -> Callable[..., torch.Tensor]:
    """The plain DDP step: ``step(x, y, sync)`` accumulates under ``no_sync`` until a step's last
    micro-batch (``sync``), whose backward all-reduces; then the optimizer steps."""
    model = DDP(net, device_ids=[ctx.device] if ctx.device.type == "cuda" else None)
    if ctx.backend == "gloo":  # bit-exact resume with > 2 ranks: see docs/your-code.md
        hpc_ddp.per_tensor_allreduce(model)

    def step(x: torch.Tensor, y: torch.Tensor, sync: bool) -> torch.Tensor:
        with contextlib.nullcontext() if sync else model.no_sync():  # 1 all-reduce a step
            loss = F.cross_entropy(model(x), y)
            (loss / accum_steps).backward()
        if sync:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return loss

    return step


def main() -> int:
    args = parse_args()
    ctx = hpc_ddp.init_distributed()  # rank, world, master from any launcher; NCCL or Gloo
    preemption = hpc_ddp.Preemption()  # USR1, TERM (and submitit's USR2) only set a flag
    dev = ctx.device

    def log(message: str) -> None:  # rank 0 speaks for the job
        if ctx.is_main:
            print(message, flush=True)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4)).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    if args.fast:  # on GPUs: the fused optimizer, and the whole step replayed as a CUDA graph
        net, opt = hpc_ddp.speed_up(net, opt, log=log)
        train_step = hpc_ddp.CapturedStep(net, opt, accum_steps=args.accum_steps, log=log)
    else:
        train_step = ddp_step(net, opt, args.accum_steps, ctx)
    torch.manual_seed(args.seed + 1 + ctx.rank)  # each rank its own dropout masks

    train_set, test_set = Blobs(args.samples, args.seed), Blobs(args.samples // 4, args.seed + 1)
    plan = hpc_ddp.ShardPlan(
        len(train_set), args.seed, ctx.world_size, args.batch_size, args.accum_steps
    )
    sampler = hpc_ddp.ResumableDistributedSampler(plan, ctx.rank)
    # A generator of its own: iter(DataLoader) draws a seed from the global RNG, which would
    # shift the dropout stream of a run resumed mid-epoch.
    loader = DataLoader(train_set, args.batch_size, sampler=sampler, generator=torch.Generator())
    test_shard = Subset(test_set, hpc_ddp.eval_indices(len(test_set), ctx.rank, ctx.world_size))
    ckpt = hpc_ddp.Checkpointer(
        args.run_dir / "checkpoints", rank=ctx.rank, world_size=ctx.world_size, log=log
    )

    epoch = step = done = 0  # done: optimizer steps taken in the current epoch
    loaded = ckpt.load_latest(expect={"world_size": ctx.world_size})
    if loaded is not None:
        net.load_state_dict(loaded.shared["model"])
        opt.load_state_dict(loaded.shared["optimizer"])
        epoch, step, done = (loaded.meta[k] for k in ("epoch", "step", "done"))
        hpc_ddp.restore_rng_state(loaded.per_rank["rng"])
        log(f"resumed from {loaded.path}: epoch {epoch + 1}, step {step}")

    def save() -> None:  # on every rank: each writes its own RNG streams
        state = {"model": net.state_dict(), "optimizer": opt.state_dict()}
        rng = {"rng": hpc_ddp.capture_rng_state()}
        ckpt.save(step, shared=state, per_rank=rng, meta=dict(epoch=epoch, step=step, done=done))

    def test() -> dict:  # exact: every test sample counted once, whatever the world size
        batches = ((x.to(dev), y.to(dev)) for x, y in DataLoader(test_shard, 256))
        return hpc_ddp.evaluate(net, batches)

    metrics: dict = {}
    loss = torch.full((), float("nan"))
    started, trained = time.perf_counter(), 0  # the training's wall time and samples, this run
    while epoch < args.epochs:
        sampler.set_epoch(epoch, plan.step_start(done))  # mid-epoch: where the checkpoint was
        for i, (x, y) in enumerate(loader):
            sync = (i + 1) % args.accum_steps == 0 or i + 1 == len(loader)  # a step's last
            loss = train_step(x.to(dev), y.to(dev), sync=sync)
            trained += len(y)
            if not sync:
                continue
            step, done = step + 1, done + 1
            if step == args.hold_at_step:  # a count, not a clock: every rank stops polling together
                print(f"rank {ctx.rank} pid {os.getpid()} holding at step {step}", flush=True)
                for _ in range(30_000):
                    if preemption.agreed():
                        break
                    time.sleep(0.01)
            if preemption.agreed():  # a collective: the same answer on every rank
                save()
                if ctx.is_main:
                    print(preemption.requeue(), flush=True)  # scontrol requeue inside Slurm
                log(f"preempted at step {step}: checkpointed; exit {hpc_ddp.EXIT_REQUEUE}")
                return hpc_ddp.EXIT_REQUEUE
            if args.checkpoint_every and step % args.checkpoint_every == 0:
                save()
        epoch, done = epoch + 1, 0
        metrics = test()
        last_loss = loss.item()
        log(f"epoch {epoch} step {step}: loss {last_loss:.4f}, test accuracy "
            f"{metrics['test_accuracy']:.4f} of {metrics['test_samples']} samples")  # fmt: skip
        save()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)  # the GPU's queued steps count too
    train_s = time.perf_counter() - started
    metrics = metrics or test()  # a rerun of a finished run
    sha = hpc_ddp.params_sha256(net.state_dict())
    if ctx.is_main:
        result = dict(metrics, steps=step, epochs=epoch, world_size=ctx.world_size)
        speed = trained * ctx.world_size / train_s if train_s > 0 else 0.0
        result.update(train_s=round(train_s, 3), samples_per_s=round(speed, 1))
        tmp = args.run_dir / "result.json.tmp"
        tmp.write_text(json.dumps(dict(result, params_sha256=sha), indent=1))
        tmp.replace(args.run_dir / "result.json")
        print(f"params_sha256={sha}", flush=True)
    return 0


if __name__ == "__main__":
    hpc_ddp.run_main(main)  # exits through hpc_ddp.shutdown: the Gloo exit-time abort cannot bite
