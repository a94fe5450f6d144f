"""The trainer's checkpoint glue: what a checkpoint holds, and a resume from it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hpc_ddp import Comm
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.loop import Times
from hpc_ddp.train.progress import Progress
from hpc_ddp.train.state import TrainState

if TYPE_CHECKING:
    from hpc_ddp.checkpoint import Staged

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


def restore(state: TrainState, cfg: TrainConfig, world_size: int, clock: Clock) -> Progress:
    """Restore the newest committed checkpoint into ``state`` (``state.run``: the model, its
    optimizer, schedule and scaler, the progress, every RNG); the progress, fresh when there is
    none.

    The run may end elsewhere than the run that wrote the checkpoint (``--epochs`` changed):
    it continues to ``cfg.epochs``, with the learning rate of this run's schedule
    (:func:`schedule_lr`); a checkpoint past that end is refused. One written by another
    number of processes resumes at its global sample position (docs/checkpoints.md).
    """
    progress = state.progress
    loaded = state.run.restore()
    if loaded is None:
        return progress
    reached = progress.epoch + 1 if progress.start else progress.epoch  # epochs begun
    if reached > cfg.epochs:
        raise ConfigError(
            f"the newest checkpoint, {loaded.path}, is at step {progress.global_step} in epoch "
            f"{reached}, past --epochs {cfg.epochs}",
            hint=f"give --epochs {reached} or more: a run continues, it is never cut back",
        )
    elastic = loaded.world_size != world_size
    if elastic:  # the schedule where this world's steps would be at the same sample
        plan = state.plan
        at = progress.epoch * plan.steps_per_epoch() + plan.steps_done(progress.start)
        state.stepper.scheduler.last_epoch = at
    schedule_lr(state, cfg)
    progress.interruptions += 1
    clock.base, clock.loop_base = progress.wall_seconds, progress.train_wall_seconds
    log.info(
        f"resumed from {loaded.path} (epoch {progress.epoch + 1}, "
        f"{progress.start} samples into it, step {progress.global_step})"
    )
    if elastic:
        log.info(
            f"resumed from {loaded.world_size} to {world_size} ranks at sample "
            f"{progress.start} of epoch {progress.epoch + 1}"
        )
    return progress


def schedule_lr(state: TrainState, cfg: TrainConfig) -> None:
    """Set the restored optimizer's learning rate to this run's schedule at the restored step.

    The schedule (``optim.lr_lambda``) is built for this run's total steps, ``cfg.epochs``
    epochs; the checkpoint's optimizer holds the rate the writing run's schedule set after its
    last step. Where the totals agree the two are the same number (LambdaLR's own arithmetic,
    ``base_lr * factor(step)``), so a resume stays bit-exact; where ``--epochs`` changed, the
    first step after the restore already takes the new schedule's rate, as every later one
    does (a cosine that had reached 0 at the old end would otherwise train one step at 0).
    """
    scheduler = state.stepper.scheduler
    step = scheduler.last_epoch  # LambdaLR counts optimizer steps in last_epoch
    groups = scheduler.optimizer.param_groups
    before = [float(group["lr"]) for group in groups]
    for group, base_lr, factor in zip(
        groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        lr = base_lr * factor(step)
        if isinstance(group["lr"], torch.Tensor):  # CUDA graphs' LR: filled, as schedulers do
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    after = [float(group["lr"]) for group in groups]
    if after != before:
        total = state.plan.steps_per_epoch() * cfg.epochs
        log.info(
            f"lr: {after[0]:.4g} at step {step} on this run's schedule ({cfg.lr_schedule} over "
            f"{total} steps, {cfg.epochs} epochs), where the checkpoint has {before[0]:.4g}"
        )


# What ``stage`` copies early: the training state, not the progress (which the save adds).
STAGED = ("model", "optimizer", "scheduler", "scaler")


def stage(state: TrainState, progress: Progress) -> Staged:
    """Queue the copy of the training state for the checkpoint of ``progress.global_step`` now
    (background saves)."""
    state.run.epoch, state.run.steps = progress.epoch, progress.global_step
    rank0_buffers(state)
    return state.run.stage(*STAGED)


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
    run = state.run
    run.epoch, run.steps = progress.epoch, progress.global_step
    run.batches_done = state.plan.steps_done(progress.start) * cfg.accum_steps
    if staged is None:  # else the model was staged after rank0_buffers
        rank0_buffers(state)
    run.save(meta={"start": progress.start, "model": cfg.model}, staged=staged)
    times.checkpoint += time.perf_counter() - t0


def rank0_buffers(state: TrainState) -> None:
    """A sharded (--fsdp) checkpoint: every rank takes rank 0's buffers (BatchNorm statistics)
    first. They are not sharded, and DCP writes one rank's copy of each, not always rank 0's;
    rank 0's is what a DDP checkpoint holds and what evaluation uses."""
    buffers = list(state.net.buffers())
    if state.run.sharded is not None and buffers:
        Comm(buffers[0].device).broadcast_buffers(state.net)
