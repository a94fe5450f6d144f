"""examples/plain_ddp.py made preemption-safe, with exact resume, by hpc_ddp.Resumable: the
changed lines are marked. Interrupted (SIGUSR1/SIGTERM, scancel --signal) it checkpoints, asks
the launcher for a requeue and exits 75; started again it continues from where it stopped and
ends with the weights of an uninterrupted run, bit for bit.

    torchrun --standalone --nproc-per-node 2 examples/resumable_ddp.py --run-dir runs/resumable
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpc_ddp  # +


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--run-dir", default="runs/plain")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)  # the same data and initial weights on every rank
    x = torch.randn(2048, 16)
    data = TensorDataset(x, x[:, :4].argmax(dim=1))  # 4 classes: the largest of 4 features
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=32, sampler=sampler)
    run = hpc_ddp.Resumable(args.run_dir, model=model, optimizer=opt, loader=loader)  # +
    for epoch in run.epochs(args.epochs):  # was: range(args.epochs) and sampler.set_epoch
        for xb, yb in run.batches():  # was: loader
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step()  # +: counts, checkpoints, and on preemption saves, requeues, exits 75
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
    if dist.get_rank() == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(args.run_dir, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    hpc_ddp.run_main(main)  # was: main(); exits through hpc_ddp.shutdown
