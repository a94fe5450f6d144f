"""torch._dynamo imported on a thread, for the runs that need it, around the process group.

Why: DDP's constructor reads torch._dynamo's settings and its forward enters a
``torch._disable_dynamo`` wrapper (eager DDP on GPUs; Gloo jobs average without DDP: see
sync.gradient_sync). The trainer never compiles, but torch offers no way around the
import, and it takes seconds (benchmarks/NOTES.md). On a thread it overlaps the start of the
process group and the data.

Two stages, because ``dist.init_process_group`` reads ``torch._dynamo`` whenever that module is
in ``sys.modules``: a half-done import there makes it wait for the whole import (found in stack
dumps of the workers: a one-stage prefetch hides only what runs before that point).
Stage one imports the heaviest of torch._dynamo's dependencies, which do not import
torch._dynamo themselves (tests/test_prefetch.py checks that against the installed torch),
while the CUDA context and the rendezvous come up; stage two imports torch._dynamo itself once
the process group exists, while the data is read and the model built. Both stages hold the GIL
most of the time, so the overlap is with waits and C++ work, not with the main thread's Python.
"""

from __future__ import annotations

import importlib
import sys
import threading

from hpc_ddp import DistEnv, pick_backend
from hpc_ddp.errors import ConfigError
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast import cuda_graphs
from hpc_ddp.train.fast.sync import gradient_sync

# About half of torch._dynamo's import time (benchmarks/NOTES.md).
STAGE_ONE = ("torch.fx.experimental.symbolic_shapes", "torch.distributed.fsdp")
TARGET = "torch._dynamo"


def needs_dynamo(config: TrainConfig, env: DistEnv) -> bool:
    """Whether this run will import torch._dynamo: only eager DDP does (sync.gradient_sync:
    NCCL or MPI jobs of several processes), and ``fully_shard`` (``--fsdp``). A captured step
    has no DDP wrapper and its optimizer skips the import (optim.py), Gloo jobs average without
    DDP, and neither reader of the data imports torchvision. Settings the trainer will refuse
    count as not needing it: the refusal comes before any import."""
    choice = cuda_graphs.choose_before_start(config, env)
    if choice is None:
        return False
    if config.fsdp:  # fully_shard imports it, whatever the backend and the world
        return True
    try:
        backend = pick_backend(bool(env.gpus), config.backend)
    except ConfigError:  # refused at the process group's start, before any import
        return False
    return gradient_sync(backend, env.world_size, choice.captured) == "ddp"


class DynamoPrefetch:
    """``start()`` before the process group, ``process_group_ready()`` once it is up."""

    def __init__(self) -> None:
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefetch", daemon=True)

    @classmethod
    def start(cls) -> DynamoPrefetch | None:
        """Start the thread (None when torch._dynamo is already imported)."""
        if TARGET in sys.modules:
            return None
        prefetch = cls()
        prefetch._thread.start()
        return prefetch

    def process_group_ready(self) -> None:
        self._ready.set()

    def _run(self) -> None:
        try:
            for name in STAGE_ONE:
                importlib.import_module(name)
            self._ready.wait()
            importlib.import_module(TARGET)
        except Exception:
            pass
