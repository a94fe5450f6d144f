"""An FSDP2 (fully_shard) loop made resumable by hpc_ddp.Resumable, for tests/test_fsdp.py.

Run under torchrun (Gloo on CPU, or NCCL with --cuda and bf16 mixed precision). Knobs for the
tests: ``--preempt-at N`` (rank 0 sends itself SIGUSR1 after step N: a real signal, agreed by
the ranks), ``--kill-at-save N`` (rank 1 SIGKILLs itself once its part of checkpoint N is
written, before the commit), ``--load-only`` (build the model, restore the newest checkpoint,
resharded to this world, through Checkpointer + ShardedState, and train nothing; ``--save-as D``
then checkpoints it again, from this world, into ``D``). Rank 0 writes
the whole (gathered) model and optimizer state to ``--out``.

    torchrun --nproc-per-node 2 tests/workers/fsdp_worker.py --run-dir R --out O [--async]
    python tests/workers/fsdp_worker.py --nproc 2 ...   (forked by hpc_ddp.spawn after the imports)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpc_ddp
from hpc_ddp.checkpoint import Checkpointer
from hpc_ddp.runtime.sharded_state import ShardedState


def build(cuda: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank, before sharding
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    if cuda:
        net = net.cuda()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs = {"mp_policy": mp} if cuda else {}
    for layer in (net[0], net[3]):
        fully_shard(layer, **kwargs)
    fully_shard(net, **kwargs)
    return net, torch.optim.AdamW(net.parameters(), lr=1e-2)


def whole(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, opt, options=options),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--async", dest="async_save", action="store_true")
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--preempt-at", type=int, default=0)
    p.add_argument("--kill-at-save", type=int, default=-1)
    p.add_argument("--load-only", action="store_true")
    p.add_argument("--save-as", default=None)
    p.add_argument("--cuda", action="store_true")
    p.add_argument("--nproc", type=int, default=0)
    args = p.parse_args()
    if args.cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.cuda else "gloo")
    rank = dist.get_rank()
    model, opt = build(args.cuda)
    if args.load_only:
        state = ShardedState({"model": model, "optimizer": opt})
        ck = Checkpointer(
            f"{args.run_dir}/checkpoints", rank=rank, world_size=dist.get_world_size(), sharded=True
        )
        into = state.state_dict()
        loaded = ck.load_latest(sharded_into=into)
        assert loaded is not None and loaded.sharded is not None
        state.load_state_dict(into)
        print(f"loaded step {loaded.step} saved by {loaded.world_size} ranks", flush=True)
        if args.save_as:
            again = Checkpointer(
                f"{args.save_as}/checkpoints",
                rank=rank,
                world_size=dist.get_world_size(),
                sharded=True,
            )
            again.save(loaded.step, shared=state.state_dict(), per_rank={}, meta={})
    else:
        torch.manual_seed(1)
        x = torch.randn(512, 16)
        data = TensorDataset(x, x[:, :4].argmax(dim=1))
        loader = DataLoader(data, batch_size=16, sampler=DistributedSampler(data, seed=0))
        run = hpc_ddp.Resumable(
            args.run_dir,
            model=model,
            optimizer=opt,
            loader=loader,
            async_save=args.async_save,
            checkpoint_every=args.checkpoint_every,
        )
        if args.kill_at_save >= 0 and rank == 1:

            def die(phase: str) -> None:
                if phase == "written" and run.steps == args.kill_at_save:
                    os.kill(os.getpid(), signal.SIGKILL)

            run.checkpointer._on_phase = die
        device = "cuda" if args.cuda else "cpu"
        for epoch in run.epochs(args.epochs):
            for xb, yb in run.batches():
                loss = F.cross_entropy(model(xb.to(device)), yb.to(device))
                opt.zero_grad()
                loss.backward()
                opt.step()
                if rank == 0 and run.steps + 1 == args.preempt_at:
                    os.kill(os.getpid(), signal.SIGUSR1)
                run.step()
            if rank == 0:
                print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
        run.close()
    state = whole(model, opt)
    if rank == 0:
        torch.save(state, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    if "--nproc" in sys.argv:
        from hpc_ddp.spawn import launch

        nproc = int(sys.argv[sys.argv.index("--nproc") + 1])
        sys.exit(launch(lambda: hpc_ddp.run_main(main), nproc))
    hpc_ddp.run_main(main)
