"""A captured step beside a thread that allocates pinned host memory, as a DataLoader's
pin-memory thread does for every batch: in CUDA's default capture mode such an allocation during
the capture fails (the run died at random with the image folder on 2 GPUs).

Needs one CUDA GPU (skips cleanly without: CI has none). A real graph, a real thread.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from hpc_ddp.train.fast.cuda_graphs import GraphedStep

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_a_capture_goes_on_while_another_thread_pins_memory() -> None:
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16 * 16, 10)
    ).to(dev)
    step = GraphedStep(net, torch.optim.SGD(net.parameters(), lr=0.1), warmup=1)
    x, y = torch.randn(64, 3, 16, 16, device=dev), torch.randint(0, 10, (64,), device=dev)
    stop, errors, pinned = threading.Event(), [], []

    def pin() -> None:  # every allocation is new host memory: the held blocks are never free
        while not stop.is_set() and len(pinned) < 20_000:
            try:
                pinned.append(torch.empty(1 << 14, pin_memory=True))
            except RuntimeError as exc:
                errors.append(exc)
                return

    step.step(x, y)  # the eager warm-up step; the thread starts right before the capture
    thread = threading.Thread(target=pin, daemon=True)
    thread.start()
    try:
        for _ in range(3):  # the capture, then replays
            step.step(x, y)
        torch.cuda.synchronize(dev)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert step.replays >= 2 and len(step.graphs) >= 1
    assert errors == [], errors[0]
    assert len(pinned) > 0
    step.release()
