"""The trainer's checkpoint glue: what a checkpoint holds, and a resume from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.checkpoint import Staged
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.runtime import rng
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.loop import Times
from hpc_ddp.train.progress import Progress
from hpc_ddp.train.state import TrainState

log = get_logger("train")


@dataclass
class Clock:
    """Two wall clocks over all of a run's attempts, each with a ``base`` (the earlier attempts'
    share, checkpointed): the run's, from ``train()``'s entry (start-up included), and the
    training loop's, from the first step to the end of the last epoch with evaluation and
    checkpoints, what a conventional script's timer around its epoch loop measures."""

    base: float = 0.0
    started: float = field(default_factory=time.perf_counter)
    loop_base: float = 0.0
    loop_started: float | None = None  # None until the loop starts: it adds nothing yet

    def elapsed(self) -> float:
        return self.base + time.perf_counter() - self.started

    def start_loop(self) -> None:
        self.loop_started = time.perf_counter()

    def loop_elapsed(self) -> float:
        running = 0.0 if self.loop_started is None else time.perf_counter() - self.loop_started
        return self.loop_base + running


def restore(state: TrainState, world_size: int, clock: Clock) -> Progress:
    """Load the newest committed checkpoint into ``state``; a fresh Progress when there is none."""
    loaded = state.ckpt.load_latest(map_location="cpu")
    if loaded is None:
        return Progress()
    if loaded.world_size != world_size:
        raise ConfigError(
            f"the checkpoint {loaded.path} was written by {loaded.world_size} processes, "
            f"this run has {world_size}",
            hint="resume with the same number of processes (nodes x processes per node): "
            "the data order and per-rank RNG streams depend on it; or start a new --run-dir",
        )
    s = loaded.shared
    state.net.load_state_dict(s["model"])
    state.stepper.optimizer.load_state_dict(s["optimizer"])
    state.stepper.scheduler.load_state_dict(s["scheduler"])
    state.stepper.scaler.load_state_dict(s["scaler"])
    progress = Progress(**s["progress"])
    progress.interruptions += 1
    clock.base, clock.loop_base = progress.wall_seconds, progress.train_wall_seconds
    rng.restore(loaded.per_rank["rng"])
    log.info(
        f"resumed from {loaded.path} (epoch {progress.epoch + 1}, "
        f"{progress.start} samples into it, step {progress.global_step})"
    )
    return progress


def training_state(state: TrainState) -> dict[str, Any]:
    """What of the state a checkpoint's ``shared`` part holds besides the progress: on rank 0,
    which alone writes it (the other ranks' state dicts would only cost them time)."""
    if state.ckpt.rank != 0:
        return {}
    stepper = state.stepper
    return {
        "model": state.net.state_dict(),
        "optimizer": stepper.optimizer.state_dict(),
        "scheduler": stepper.scheduler.state_dict(),
        "scaler": stepper.scaler.state_dict(),
    }


def stage(state: TrainState, step: int) -> Staged:
    """Queue the copy of the training state for checkpoint ``step`` now (background saves)."""
    return state.ckpt.stage(step, training_state(state))


def save(
    state: TrainState,
    cfg: TrainConfig,
    progress: Progress,
    times: Times,
    clock: Clock,
    staged: Staged | None = None,
) -> None:
    """Checkpoint ``progress.global_step``; ``staged``: its training state, copied earlier by
    :func:`stage` (background saves only)."""
    t0 = time.perf_counter()
    progress.epoch_times = times.to_dict()
    progress.wall_seconds = clock.elapsed()
    progress.train_wall_seconds = clock.loop_elapsed()
    # Shallow: save() writes it at once, save_async() copies it; asdict() would first deep-copy
    # the growing history on the training thread.
    shared = {"progress": vars(progress).copy()}
    if staged is None:
        shared.update(training_state(state))
    meta = {"epoch": progress.epoch, "start": progress.start, "model": cfg.model}
    per_rank = {"rng": rng.capture()}
    if cfg.async_checkpoint:  # waits for the previous save (raising its error), then copies
        state.ckpt.save_async(
            progress.global_step, shared=shared, per_rank=per_rank, meta=meta, staged=staged
        )
    else:
        state.ckpt.save(progress.global_step, shared=shared, per_rank=per_rank, meta=meta)
    times.checkpoint += time.perf_counter() - t0
