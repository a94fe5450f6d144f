"""A Resumable DDP script that keeps its own evidence of what it trained on, for the elastic-
resume tests: each rank appends the dataset index of every sample of every batch it trained on
to RUN_DIR/samples/<job>-<rank>.txt ("EPOCH INDEX" lines), before the step is counted (and
perhaps checkpointed), so the test checks the sample accounting from these files and not from
hpc_ddp's own claim. At the end rank 0 writes the held-out accuracy to RUN_DIR/accuracy.json.

2000 training samples (not a multiple of 2 or 4 ranks x batch 32: the last batch is short).

Usage: elastic_samples.py --run-dir DIR [--epochs N]
"""

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import hpc_ddp

TRAIN, TEST = 2000, 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same data and initial weights on every rank
    x = torch.randn(TRAIN + TEST, 16)
    y = x[:, :4].argmax(dim=1)  # 4 classes: the largest of 4 features
    data = TensorDataset(x[:TRAIN], y[:TRAIN], torch.arange(TRAIN))
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=32, sampler=DistributedSampler(data, seed=0))
    run = hpc_ddp.Resumable(args.run_dir, model=model, optimizer=opt, loader=loader, seed=7)
    samples = Path(args.run_dir) / "samples"
    samples.mkdir(exist_ok=True)
    job = os.environ.get("SLURM_JOB_ID", f"pid{os.getpid()}")
    with (samples / f"{job}-{rank}.txt").open("a") as log:
        for epoch in run.epochs(args.epochs):
            for xb, yb, ib in run.batches():
                loss = F.cross_entropy(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.write("".join(f"{epoch} {i}\n" for i in ib.tolist()))
                log.flush()
                run.step()
            if rank == 0:
                print(f"epoch {epoch + 1}: loss {loss.item():.4f}", flush=True)
    if rank == 0:
        net.eval()
        with torch.no_grad():
            accuracy = (net(x[TRAIN:]).argmax(dim=1) == y[TRAIN:]).float().mean().item()
        (Path(args.run_dir) / "accuracy.json").write_text(json.dumps({"accuracy": accuracy}))
    dist.destroy_process_group()


if __name__ == "__main__":
    hpc_ddp.run_main(main)
