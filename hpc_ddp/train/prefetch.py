"""torch._dynamo imported on a thread, for the runs that need it, around the process group.

Why: DDP's constructor reads torch._dynamo's settings and its forward enters a
``torch._disable_dynamo`` wrapper, and torchvision's reader imports torchvision.ops, which
imports torch._dynamo too. The trainer never compiles, but torch offers no way around the
import, and it is slow: 1.2-1.9 s on this project's 2-core CPU, 4.5 s on the H200 machines
(benchmarks/NOTES.md). On a thread it overlaps the start of the process group and the data.

Two stages, because ``dist.init_process_group`` reads ``torch._dynamo`` whenever that module is
in ``sys.modules``: a half-done import there makes it wait for the whole import (found in stack
dumps of the workers: the former one-stage prefetch hid only what ran before that point).
Stage one imports the heaviest of torch._dynamo's dependencies, which do not import
torch._dynamo themselves (tests/test_prefetch.py checks that against the installed torch),
while the CUDA context and the rendezvous come up; stage two imports torch._dynamo itself once
the process group exists, while the data is read and the model built. Both stages hold the GIL
most of the time, so the overlap is with waits and C++ work, not with the main thread's Python.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import threading
from collections.abc import Mapping

from hpc_ddp.cluster import DistEnv, detect_env
from hpc_ddp.cluster.devices import count_visible_gpus, has_nvidia_driver
from hpc_ddp.train import cuda_graphs
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.state import wraps_ddp

# About half of torch._dynamo's import time (604 of its ~890 modules on torch 2.14).
STAGE_ONE = ("torch.fx.experimental.symbolic_shapes", "torch.distributed.fsdp")
TARGET = "torch._dynamo"


def needs_dynamo(config: TrainConfig, env: DistEnv) -> bool:
    """Whether this run will import torch._dynamo: eager DDP (jobs of several processes) or
    torchvision's reader. A captured step has no DDP wrapper and its optimizer skips the import
    (optim.py), so on the GPU-resident data path it never pays for it; nor does a job of one
    process (state.build_state wraps no DDP). Settings the trainer will refuse count as not
    needing it: the refusal comes before any import."""
    choice = cuda_graphs.choose_before_start(config, env)
    if choice is None:
        return False
    return wraps_ddp(env.world_size, choice.captured) or config.data_path == "torchvision"


def import_before_fork(
    config: TrainConfig,
    nproc: int,
    environ: Mapping[str, str] = os.environ,
    *,
    proc_root: str = "/proc",
    cores: int | None = None,
) -> bool:
    """Whether the ``--nproc-per-node`` parent imports torch._dynamo before forking, so that its
    workers inherit it instead of each importing it on its prefetch thread.

    Only for CPU workers (no NVIDIA driver, nothing in CUDA_VISIBLE_DEVICES) that will import
    it (``needs_dynamo``: eager DDP over Gloo, unless the trainer refuses the run) and have
    fewer than two cores each: there the workers' imports compete
    with their own start-up for the cores, and one import in the parent is cheaper (2 ranks on
    2 cores: 1.4-2.0 s less CPU time, the command 0.1-0.55 s sooner; benchmarks/NOTES.md).
    With cores to spare, and on GPU machines, each worker's import overlaps its start-up on a
    core of its own, as before. Touches no CUDA: the parent must not, before a fork.
    """
    if nproc < 2 or count_visible_gpus(environ, proc_root) or has_nvidia_driver(proc_root):
        return False
    if cores is None:  # the cores this process may run on (taskset, a Slurm allocation)
        affinity = getattr(os, "sched_getaffinity", None)  # Linux only: else all of them
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    worker = dataclasses.replace(detect_env({}), world_size=nproc, local_world_size=nproc)
    return cores < 2 * nproc and needs_dynamo(config, worker)  # a CPU worker's view


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
