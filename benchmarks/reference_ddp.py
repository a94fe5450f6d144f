"""The conventional DDP tutorial script: the baseline the toolkit is measured against.

Written from the published description of the usual tutorial (CIFAR-100, LeNet, 10 epochs, batch
64 per GPU, Adam 1e-3, torchvision dataset with ToTensor + Normalize, DistributedSampler, a
DataLoader with no workers, an all_gather evaluation each epoch, mp.spawn), on purpose without
optimizations. Modes: ``ddp`` (one process per GPU), ``single`` (one GPU, no DDP) and ``dp``
(``nn.DataParallel`` over the GPUs, one process).

The one change from the tutorial: the CIFAR class skips its MD5 checks, so that the synthetic
CIFAR-format files this project writes (there is no internet on the GPU machines) are accepted.

Prints one JSON line (``REFERENCE_RESULT {...}``) with the training time (first epoch's start
to the last evaluation's end, rank 0) and the final test accuracy; with ``--json`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import ClassVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MEAN, STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)


class CIFAR100(datasets.CIFAR100):
    """torchvision's CIFAR100 with its MD5 checks off (synthetic files have other checksums)."""

    train_list: ClassVar = [[f, None] for f, _ in datasets.CIFAR100.train_list]
    test_list: ClassVar = [[f, None] for f, _ in datasets.CIFAR100.test_list]
    meta: ClassVar = {**datasets.CIFAR100.meta, "md5": None}


class LeNet(nn.Module):
    def __init__(self, num_classes: int = 100) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def datasets_(root: str) -> tuple[CIFAR100, CIFAR100]:
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize(MEAN, STD)])
    train = CIFAR100(root=root, train=True, download=False, transform=transform)
    test = CIFAR100(root=root, train=False, download=False, transform=transform)
    return train, test


def train_epoch(model, loader, optimizer, criterion, device) -> None:
    model.train()
    for images, labels in loader:
        images, labels = images.to(device), labels.to(device)
        optimizer.zero_grad()
        loss = criterion(model(images), labels)
        loss.backward()
        optimizer.step()


def predict(model, loader, device) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    preds, targets = [], []
    with torch.no_grad():
        for images, labels in loader:
            preds.append(model(images.to(device)).argmax(dim=1))
            targets.append(labels.to(device))
    return torch.cat(preds), torch.cat(targets)


def ddp_worker(rank: int, world_size: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    if args.cpu:  # smoke-test mode for machines without a GPU
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        device = torch.device("cpu")
    else:
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    torch.manual_seed(args.seed)
    train, test = datasets_(args.data)
    sampler = DistributedSampler(
        train, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
    )
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, num_workers=0)
    test_sampler = DistributedSampler(test, num_replicas=world_size, rank=rank, shuffle=False)
    test_loader = DataLoader(test, batch_size=args.batch_size, sampler=test_sampler, num_workers=0)
    model = DDP(LeNet().to(device), device_ids=None if args.cpu else [rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    start = time.time()
    accuracy = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_epoch(model, loader, optimizer, criterion, device)
        preds, targets = predict(model, test_loader, device)
        all_preds = [torch.zeros_like(preds) for _ in range(world_size)]
        all_targets = [torch.zeros_like(targets) for _ in range(world_size)]
        dist.all_gather(all_preds, preds)
        dist.all_gather(all_targets, targets)
        if rank == 0:
            accuracy = (torch.cat(all_preds) == torch.cat(all_targets)).float().mean().item()
            print(f"epoch {epoch}: test accuracy {accuracy:.4f}", flush=True)
    if rank == 0:
        report(args, world_size, time.time() - start, accuracy)
    dist.destroy_process_group()


def single_process(args: argparse.Namespace, gpus: int) -> None:
    """``single``: one GPU; ``dp``: nn.DataParallel splitting each batch over ``gpus`` GPUs."""
    device = torch.device("cpu" if args.cpu else "cuda")
    torch.manual_seed(args.seed)
    train, test = datasets_(args.data)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, num_workers=0)
    test_loader = DataLoader(test, batch_size=args.batch_size, shuffle=False, num_workers=0)
    model = LeNet().to(device)
    if args.mode == "dp":
        model = nn.DataParallel(model, device_ids=list(range(gpus)))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    criterion = nn.CrossEntropyLoss()
    start = time.time()
    accuracy = 0.0
    for epoch in range(args.epochs):
        train_epoch(model, loader, optimizer, criterion, device)
        preds, targets = predict(model, test_loader, device)
        accuracy = (preds == targets).float().mean().item()
        print(f"epoch {epoch}: test accuracy {accuracy:.4f}", flush=True)
    report(args, gpus, time.time() - start, accuracy)


def report(args: argparse.Namespace, gpus: int, train_s: float, accuracy: float) -> None:
    result = {
        "script": "reference_ddp",
        "mode": args.mode,
        "gpus": gpus,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "train_time_s": round(train_s, 3),
        "test_accuracy": accuracy,
        "gpu_name": "cpu" if args.cpu else torch.cuda.get_device_name(0),
    }
    print("REFERENCE_RESULT " + json.dumps(result), flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="directory holding cifar-100-python/")
    parser.add_argument("--mode", choices=("ddp", "single", "dp"), default="ddp")
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--batch-size", type=int, default=64, help="per GPU (ddp) or total")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=29555)
    parser.add_argument("--cpu", action="store_true", help="smoke test on the CPU (Gloo)")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    if args.mode == "ddp":
        mp.spawn(ddp_worker, args=(args.gpus, args), nprocs=args.gpus, join=True)
    else:
        single_process(args, args.gpus if args.mode == "dp" else 1)


if __name__ == "__main__":
    main()
