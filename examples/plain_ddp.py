"""A plain PyTorch DDP training script, written for torchrun: nothing of hpc-ddp in it.

examples/resumable_ddp.py is the same script made preemption-safe with exact resume by
hpc_ddp.Resumable (docs/your-code.md shows the difference, line by line).

    torchrun --standalone --nproc-per-node 2 examples/plain_ddp.py --run-dir runs/plain
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


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
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if dist.get_rank() == 0:
            print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
    if dist.get_rank() == 0:
        os.makedirs(args.run_dir, exist_ok=True)
        torch.save(net.state_dict(), os.path.join(args.run_dir, "model.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
