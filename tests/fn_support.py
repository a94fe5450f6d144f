"""Functions the Executor tests submit: a submitit task unpickles them by module name, so they
live in a module of their own (tests/ is put on the jobs' PYTHONPATH)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def whoami(tag: str) -> dict[str, Any]:
    """What a task was told before the function ran: the torch variables and the spec's env."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    return {
        "tag": tag,
        **{k: os.environ.get(k) for k in keys},
        "FN_SETUP": os.environ.get("FN_SETUP"),
    }


def all_reduce(x: float) -> tuple[int, int, float]:
    """A real collective over the process group the task started: sum of x * (rank + 1)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(x) * (dist.get_rank() + 1)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item()


def hold_once(state_dir: str) -> int:
    """Counts its runs in ``state_dir``; the first run holds (until preempted), a rerun returns
    the number of runs. A function that resumes finds its progress where it left it."""
    runs = Path(state_dir) / "runs"
    count = int(runs.read_text()) + 1 if runs.exists() else 1
    runs.write_text(str(count))
    if count == 1:
        (Path(state_dir) / "holding").touch()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the test's USR2 ends this run
            time.sleep(0.1)
        raise RuntimeError("hold_once was never preempted")
    return count


def resumable_steps(run_dir: str, epochs: int) -> tuple[int, int, str | None]:
    """A small loop on hpc_ddp.Resumable inside an Executor task (distributed=True): returns
    this rank's optimizer steps, the epoch it ended at and the checkpoint it resumed from."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    import hpc_ddp

    torch.manual_seed(0)
    x = torch.randn(64, 4)
    data = TensorDataset(x, (x.sum(dim=1) > 0).long())
    net = torch.nn.Linear(4, 2)
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=8, sampler=DistributedSampler(data, seed=0))
    run = hpc_ddp.Resumable(run_dir, model=model, optimizer=opt, loader=loader)
    resumed = str(run.resumed_from) if run.resumed_from else None
    for _epoch in run.epochs(epochs):
        for xb, yb in run.batches():
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step()
    run.close()
    return run.steps, run.epoch, resumed
