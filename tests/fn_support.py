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
