"""The trainer's checkpoint glue: what a checkpoint holds, and a resume from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

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
    """The run's wall time over all its attempts: ``base`` is the earlier ones' (checkpointed)."""

    base: float = 0.0
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return self.base + time.perf_counter() - self.started


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
    clock.base = progress.wall_seconds
    rng.restore(loaded.per_rank["rng"])
    log.info(
        f"resumed from {loaded.path} (epoch {progress.epoch + 1}, "
        f"{progress.start} samples into it, step {progress.global_step})"
    )
    return progress


def save(
    state: TrainState, cfg: TrainConfig, progress: Progress, times: Times, clock: Clock
) -> None:
    t0 = time.perf_counter()
    progress.epoch_times = times.to_dict()
    progress.wall_seconds = clock.elapsed()
    stepper = state.stepper
    shared = {
        "model": state.net.state_dict(),
        "optimizer": stepper.optimizer.state_dict(),
        "scheduler": stepper.scheduler.state_dict(),
        "scaler": stepper.scaler.state_dict(),
        # Shallow: save() writes it at once, save_async() copies it; asdict() would first
        # deep-copy the growing history on the training thread.
        "progress": vars(progress).copy(),
    }
    meta = {"epoch": progress.epoch, "start": progress.start, "model": cfg.model}
    # Async: waits for the previous save (raising its error), copies, writes in the background.
    write = state.ckpt.save_async if cfg.async_checkpoint else state.ckpt.save
    write(progress.global_step, shared=shared, per_rank={"rng": rng.capture()}, meta=meta)
    times.checkpoint += time.perf_counter() - t0
