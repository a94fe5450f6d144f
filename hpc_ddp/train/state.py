"""Everything a run trains with, built in one place: ``build_state(...) -> TrainState``.

The model (from the registry, placed on this process's devices, wrapped in DDP or averaged per
tensor as ``gradient_sync`` says), its optimizer, schedule and scaler, the step runner, this rank's
data and the resumable-loop object that checkpoints them (``hpc_ddp.Resumable``, as a script of
the user's has): all made here, in this order, on every rank.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp import Comm, Preemption, Resumable, ShardPlan, seed_everything
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train import cuda_graphs, metric_writers, registry
from hpc_ddp.train.cifar import models
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.data_source import EvalData, Splits, TrainData
from hpc_ddp.train.loop import Stepper, timed_allreduce
from hpc_ddp.train.optim import amp_dtype, build_optimizer, lr_lambda
from hpc_ddp.train.progress import Progress
from hpc_ddp.train.tensor_average import PerTensorAverage

if TYPE_CHECKING:
    from hpc_ddp import DistContext

log = get_logger("train")


@dataclass
class TrainState:
    amp: torch.dtype | None
    plan: ShardPlan
    net: torch.nn.Module  # the bare module: checkpoints, evaluation, the weights' fingerprint
    model: torch.nn.Module  # what the step runs: DDP(net), or net (Gloo, captured, one process)
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
    choice = cuda_graphs.choose(cfg, ctx.device, amp, len(devices))
    log.info(choice.line)
    model = net
    sync = gradient_sync(ctx.backend, comm.world_size, choice.captured)
    if sync == "ddp":
        ids = [ctx.device] if ctx.device.type == "cuda" and len(devices) == 1 else None
        model = DDP(net, device_ids=ids, **ddp_options(net, one_device=len(devices) == 1))
    opt = build_optimizer(cfg, net.parameters())
    total = plan.steps_per_epoch() * cfg.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg, total))
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=amp == torch.float16)
    if choice.captured:
        stepper: Stepper = cuda_graphs.GraphedStepper(net, opt, sched, scaler, amp, out_device)
    else:
        stepper = Stepper(model, opt, sched, scaler, amp, out_device)
    if sync == "per_tensor":
        stepper.averager = PerTensorAverage(net, sync_buffers=training_reads_buffers(net))
    if isinstance(model, DDP):
        # DDP over Gloo (only where gradient_sync is overridden, as tests comparing with DDP
        # do) reduces per tensor in a hook, as PerTensorAverage does: bit-exact resume at any
        # world size. NCCL keeps DDP's flat buckets and its C++ all-reduce unless timed (a
        # Python hook per bucket costs host time on every step: benchmarks/NOTES.md).
        gloo = ctx.backend == "gloo"
        stepper.comm_timer.per_tensor = gloo
        if gloo or cfg.time_allreduce:
            model.register_comm_hook(stepper.comm_timer, timed_allreduce)
    train_data, eval_data = splits.make(plan, rank=rank, world_size=world_size, device=in_device)
    progress = Progress()
    run = Resumable(
        cfg.run_dir,
        keep=cfg.keep_checkpoints,
        async_save=cfg.async_checkpoint,
        requeue=cfg.requeue,
        preemption=preemption,
        restore=False,  # Trainer.run restores, once the run's files are open
        log=log.info,
        model=net,
        optimizer=opt,
        scheduler=sched,
        scaler=scaler,
        progress=progress,
    )
    if isinstance(stepper, cuda_graphs.GraphedStepper):
        stepper.graphed.before_capture = run.wait  # no background save overlaps the capture
        stepper.evaluation.may_record = lambda: not run.in_flight  # nor evaluation's recording
    return TrainState(
        amp, plan, net, model, choice.captured, stepper, train_data, eval_data, progress, run
    )


GradientSync = Literal["ddp", "per_tensor", "none"]


def gradient_sync(backend: str, world_size: int, captured: bool) -> GradientSync:
    """How the eager step averages gradients over the ranks.

    - "none": the captured step all-reduces itself; a job of one process has nothing to
      average (DDP would all-reduce each gradient with itself, an identity bit for bit, and cost
      its wrapper's host time per step and its torch._dynamo import: prefetch.needs_dynamo).
    - "per_tensor" over Gloo: each gradient by its own all-reduce after backward, DDP's
      per-tensor comm hook's arithmetic without DDP and its torch._dynamo import
      (tensor_average.py).
    - "ddp" otherwise (NCCL, MPI): DDP's buckets, overlapped with backward.
    """
    if world_size == 1 or captured:
        return "none"
    return "per_tensor" if backend == "gloo" else "ddp"


def ddp_options(net: torch.nn.Module, *, one_device: bool = True) -> dict[str, bool]:
    """DDP's settings for this trainer: less host work per step, the same results.

    - ``gradient_as_bucket_view``: gradients live in DDP's all-reduce buckets, instead of being
      copied in and out of them by one kernel per parameter and direction every step.
    - ``forward_sync_buffers=False`` when every buffer is a normalization layer's running
      statistics: in training those layers use the batch's statistics, so rank 0's buffers and
      every gradient are what they would be with DDP's broadcast before each forward (one
      NCCL broadcast plus a copy per buffer). Rank 0's buffers reach the other ranks where they
      are read: before each evaluation (``Comm.broadcast_buffers``); checkpoints hold rank 0's.
      Any other buffer may be read in training, so such a model keeps DDP's broadcast.
      (torch 2.13 renamed ``broadcast_buffers`` to this; the old name warns on every rank,
      and older releases know only the old one, which they get. Unlike
      ``broadcast_buffers=False`` it still broadcasts buffers once at construction: the model
      is built from the same seed on every rank, so that copies equal values.)

    tests/test_train_ddp.py checks both against DDP's defaults, bit for bit. A model split
    across a process's GPUs keeps DDP's defaults: only the one-device case is known to gain
    and was tested on GPUs (benchmarks/NOTES.md).
    """
    if not one_device:
        return {}
    return {"gradient_as_bucket_view": True, _SYNC_BUFFERS: training_reads_buffers(net)}


def training_reads_buffers(net: torch.nn.Module) -> bool:
    """Whether ``net`` has a buffer other than a normalization layer's running statistics (which
    training does not read): then rank 0's buffers are broadcast before each step's forward."""
    norm = torch.nn.modules.batchnorm._NormBase
    owners = [m for m in net.modules() if next(m.buffers(recurse=False), None) is not None]
    return not all(isinstance(m, norm) for m in owners)


# DDP's keyword for the broadcast of buffers before each forward, by torch release.
_SYNC_BUFFERS = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else "broadcast_buffers"
)
