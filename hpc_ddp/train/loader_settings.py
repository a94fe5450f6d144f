"""How a DataLoader is set up: worker processes, pinned memory, persistence and prefetch.

A dataset whose items are decoded from files (``from_disk``: the image folders of
image_folder.py, or a plug-in dataset that sets the attribute) gets its workers from the cores
this process may use, unless ``--num-workers`` says otherwise. A dataset held in memory keeps
the main process (no workers) unless asked: indexing an array is faster than handing a batch
over from another process.

The cores of this process: under Slurm, one task per rank, its own CPUs (the task's affinity,
capped by ``SLURM_CPUS_PER_TASK`` for a step whose tasks are not bound to cores); under a
launcher whose ranks share one CPU set (torchrun, ``--nproc-per-node``, ``srun torchrun``), that
set divided by the ranks on this node. One core stays with the training process, which
launches the step and collates nothing itself; each other core decodes in a worker.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpc_ddp import die_with_parent, usable_cores

# More workers than this mostly add processes to start and memory to hold: each worker holds
# `PREFETCH` batches in flight, and decoding beyond the GPU's pace buys nothing.
MAX_AUTO_WORKERS = 16
# Batches each worker decodes ahead: a few, so one slow file does not stall the step.
PREFETCH = 4


@dataclass(frozen=True)
class LoaderSettings:
    workers: int
    pin_memory: bool
    cores: int  # the cores this process may use (what the workers were chosen from)
    cores_from: str  # where ``cores`` came from, for the log and the starvation line
    chosen: bool  # True: workers chosen here; False: --num-workers gave them

    @property
    def persistent(self) -> bool:
        return self.workers > 0

    def loader_kwargs(self) -> dict[str, Any]:
        """The DataLoader's keyword arguments for these settings."""
        kwargs: dict[str, Any] = {"num_workers": self.workers, "pin_memory": self.pin_memory}
        if self.workers:
            kwargs.update(persistent_workers=True, prefetch_factor=PREFETCH)
            # The trainer leaves through os._exit, which stops no persistent worker: without
            # this they would outlive the run (holding its output open) until they notice.
            kwargs["worker_init_fn"] = functools.partial(_worker_init, os.getpid())
        return kwargs

    def describe(self) -> str:
        how = "chosen from the cores; --num-workers N overrides" if self.chosen else "--num-workers"
        extra = f", prefetch {PREFETCH} batches each, persistent" if self.workers else ""
        pinned = ", pinned memory" if self.pin_memory else ""
        return (
            f"data loader: {self.workers} worker process(es) ({how}){extra}{pinned}; "
            f"{self.cores} core(s) for this process ({self.cores_from})"
        )


def _worker_init(parent: int, _worker_id: int) -> None:
    die_with_parent(parent)


def process_cores(
    source: str, local_world_size: int, environ: Mapping[str, str]
) -> tuple[int, str]:
    """(cores this process may use, where that came from)."""
    usable = usable_cores()
    if source == "slurm":  # one task per rank: the affinity is the task's own
        per_task = environ.get("SLURM_CPUS_PER_TASK", "")
        if per_task.isdigit() and 0 < int(per_task) < usable:
            return int(per_task), f"SLURM_CPUS_PER_TASK={per_task}"
        return usable, "this task's CPU affinity"
    ranks = max(local_world_size, 1)
    if ranks == 1:
        return usable, "its CPU affinity"
    return max(usable // ranks, 1), f"{usable} usable / {ranks} processes on this node"


def choose(
    num_workers: int | None,
    *,
    from_disk: bool,
    cuda: bool,
    source: str,
    local_world_size: int,
    environ: Mapping[str, str] | None = None,
) -> LoaderSettings:
    """``num_workers`` None: chosen here (cores - 1, at least 1, at most MAX_AUTO_WORKERS, for a
    dataset read from disk; 0 for one in memory); else as given."""
    cores, origin = process_cores(
        source, local_world_size, os.environ if environ is None else environ
    )
    if num_workers is not None:
        workers, chosen = num_workers, False
    else:
        workers = min(max(cores - 1, 1), MAX_AUTO_WORKERS) if from_disk else 0
        chosen = True
    return LoaderSettings(workers, cuda, cores, origin, chosen)


def reads_from_disk(dataset: object) -> bool:
    """The dataset says its items are decoded from files (``from_disk = True``)."""
    return bool(getattr(dataset, "from_disk", False))
