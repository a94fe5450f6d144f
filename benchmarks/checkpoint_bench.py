"""Checkpoint cost for a ResNet-18-sized state: ``python benchmarks/checkpoint_bench.py``.

Compares the protocol's save (hash while writing, fsync, manifest, rename, pointer) with a bare
``torch.save`` to the same disk, so the price of safety is a number rather than a guess.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torchvision

from hpc_ddp.checkpoint import Checkpointer


def _time(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", type=Path, default=None, help="where to write (default: a tmp dir)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--with-optimizer", action="store_true", help="add SGD momentum buffers")
    a = p.parse_args()

    model = torchvision.models.resnet18(weights=None)
    shared: dict = {"model": model.state_dict()}
    if a.with_optimizer:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        opt.step()
        shared["optimizer"] = opt.state_dict()
    buf = io.BytesIO()
    torch.save(shared, buf)
    mib = buf.tell() / 2**20

    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        root = Path(d)
        ck = Checkpointer(root / "run", rank=0, world_size=1, keep=2, log=lambda _: None)
        step = iter(range(1, 10_000))
        rows = {
            "torch.save to memory (serialisation only)": _time(
                lambda: torch.save(shared, io.BytesIO()), a.repeat
            ),
            "torch.save to a file, no fsync": _time(
                lambda: torch.save(shared, root / "plain.pt"), a.repeat
            ),
            "Checkpointer.save (hash, fsync, manifest, rename, latest)": _time(
                lambda: ck.save(next(step), shared=shared, per_rank={}, meta={}), a.repeat
            ),
            "Checkpointer.load_latest (verify sha256 + weights_only load)": _time(
                ck.load_latest, a.repeat
            ),
        }
    print(
        f"state: {mib:.1f} MiB ({'model + SGD momentum' if a.with_optimizer else 'model'}), "
        f"{a.repeat} runs, {os.cpu_count()} CPUs, torch {torch.__version__}"
    )
    print("| operation | median s | min s | MiB/s (median) |")
    print("|---|---|---|---|")
    for name, times in rows.items():
        med = statistics.median(times)
        print(f"| {name} | {med:.3f} | {min(times):.3f} | {mib / med:.0f} |")


if __name__ == "__main__":
    main()
