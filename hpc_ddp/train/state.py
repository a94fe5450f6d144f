"""Everything a run trains with, built in one place: ``build_state(...) -> TrainState``.

The model (from the registry, placed on this process's devices, wrapped in DDP or averaged per
tensor as ``gradient_sync`` says), its optimizer, schedule and scaler, the step runner, this rank's
data and the resumable-loop object that checkpoints them (``hpc_ddp.Resumable``, as a script of
the user's has): all made here, in this order, on every rank.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hpc_ddp import Comm, Preemption, Resumable, ShardPlan, seed_everything
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train import metric_writers, registry, sharding
from hpc_ddp.train.cifar import models
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.data_source import EvalData, Splits, TrainData
from hpc_ddp.train.fast import choice as fast
from hpc_ddp.train.loop import Stepper
from hpc_ddp.train.optim import amp_dtype, build_optimizer, lr_lambda
from hpc_ddp.train.progress import Progress

if TYPE_CHECKING:
    from hpc_ddp import DistContext

log = get_logger("train")


@dataclass
class TrainState:
    amp: torch.dtype | None
    plan: ShardPlan
    net: torch.nn.Module  # the bare module: checkpoints, evaluation, the weights' fingerprint
    model: torch.nn.Module  # what the step runs: DDP(net), or net (Gloo, captured, one process,
    # or sharded in place with --fsdp: its parameters are then DTensors)
    captured: bool  # the step is a CUDA graph (cuda_graphs.py)
    stepper: Stepper
    train_data: TrainData
    eval_data: EvalData
    progress: Progress  # where training stands: restored by ``run``, saved with the rest
    run: Resumable  # checkpoints of all of the above, the RNG and the preemption signals


def preflight(cfg: TrainConfig, ctx: DistContext) -> torch.dtype | None:
    """Settings this machine cannot run, refused before the run dir is touched; the AMP dtype."""
    amp = amp_dtype(cfg, ctx.device)
    metric_writers.check_installed(cfg.metrics)
    if cfg.fsdp:
        sharding.check_devices(ctx)
    if cfg.sync_bn and ctx.device.type != "cuda":
        raise ConfigError(
            "sync_bn needs GPUs: DDP runs SyncBatchNorm only on CUDA modules",
            hint="drop --sync-bn on CPU (each rank then keeps its own BatchNorm statistics)",
        )
    return amp


def load_splits(cfg: TrainConfig, ctx: DistContext, comm: Comm) -> Splits:
    splits: Splits = registry.resolve("dataset", cfg.dataset)(cfg, ctx, comm)
    return splits


def build_net(cfg: TrainConfig, num_classes: int, devices: list[torch.device]) -> torch.nn.Module:
    seed_everything(cfg.seed)  # identical initial weights on every rank and every run
    net = models.build_model(cfg.model, num_classes, sync_bn=cfg.sync_bn)
    if len(devices) > 1 and not isinstance(net, torch.nn.Sequential):
        raise ConfigError(
            f"model {cfg.model!r} is a {type(net).__name__}: only a torch.nn.Sequential can be "
            f"split across the {len(devices)} GPUs of one process (by its top-level stages)",
            hint="drive one GPU per process (--gpus-per-process 1)",
        )
    return models.place_model(net, devices)


def build_state(
    cfg: TrainConfig,
    ctx: DistContext,
    comm: Comm,
    amp: torch.dtype | None,
    splits: Splits,
    preemption: Preemption,
) -> TrainState:
    rank, world_size = ctx.env.rank, ctx.env.world_size
    plan = ShardPlan(
        n=splits.n,
        seed=cfg.seed,
        world_size=world_size,
        micro_batch=cfg.batch_size,
        accum_steps=cfg.accum_steps,
    )
    devices = ctx.devices  # several when one process drives several GPUs
    net = build_net(cfg, splits.num_classes, devices)
    in_device, out_device = models.input_device(net), models.output_device(net)
    # Captured or eager; the averaging. --fsdp: eager, the model sharded (sharding.py).
    step = (
        sharding.plan_step(cfg, ctx, amp)
        if cfg.fsdp
        else fast.plan_step(cfg, ctx, amp, comm.world_size)
    )
    # The model the step runs, its optimizer and the inputs' memory format: hpc_ddp.speed_up
    # (a plug-in model's layout tried on an input first) before DDP, or FSDP2's shards.
    model, opt, layout = step.build(net, functools.partial(build_optimizer, cfg), splits.example)
    total = plan.steps_per_epoch() * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp == torch.float16)
    stepper = step.stepper(net, model, opt, sched, scaler, out_device)
    train_data, eval_data = step.feed(
        layout,
        *splits.make(plan, rank=rank, world_size=world_size, device=in_device),
    )
    progress = Progress()
    run = Resumable(
        cfg.run_dir,
        keep=cfg.keep_checkpoints,
        async_save=cfg.async_checkpoint,
        requeue=cfg.requeue,
        preemption=preemption,
        restore=False,  # Trainer.run restores, once the run's files are open
        seed=cfg.seed,  # a resume on another world size derives its RNG streams from it
        log=log.info,
        model=net,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        progress=progress,
    )
    step.share_with(stepper, run)
    return TrainState(
        amp, plan, net, model, step.captured, stepper, train_data, eval_data, progress, run
    )
