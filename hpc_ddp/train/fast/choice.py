"""What the trainer asks the speed machinery (see the package's docstring): the step, its
layout and optimizer kernel, the start-up threads, the step-rate advice. The fast path is chosen
here, once per run."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp import SpeedUp, speed_up
from hpc_ddp.log import get_logger
from hpc_ddp.train import registry
from hpc_ddp.train.data_source import EvalData, TrainData
from hpc_ddp.train.fast import cuda_graphs
from hpc_ddp.train.fast.gpu_data import GpuEvalData, GpuTrainData
from hpc_ddp.train.fast.kernel_warmup import KernelWarmup
from hpc_ddp.train.fast.prefetch import DynamoPrefetch, needs_dynamo
from hpc_ddp.train.fast.step_rate import LatencyAdvice
from hpc_ddp.train.fast.sync import GradientSync, ddp_options, gradient_sync, training_reads_buffers
from hpc_ddp.train.fast.tensor_average import PerTensorAverage
from hpc_ddp.train.loop import Stepper, timed_allreduce

if TYPE_CHECKING:
    from hpc_ddp import DistContext, DistEnv, Resumable
    from hpc_ddp.train.config import TrainConfig

__all__ = ["LatencyAdvice", "StartUp", "StepPlan", "plan_step"]

log = get_logger("train")


@dataclass(frozen=True)
class StepPlan:
    """How this run steps: captured or eager, and how the ranks average gradients."""

    cfg: TrainConfig
    ctx: DistContext
    amp: torch.dtype | None
    captured: bool  # the step is a CUDA graph (cuda_graphs.py)
    sync: GradientSync

    def speed_up(
        self,
        net: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        example: Callable[[], torch.Tensor] | None = None,
    ) -> SpeedUp:
        """``hpc_ddp.speed_up`` as the config asks (``memory_format``, ``fused_optimizer``),
        said beside the ``CUDA graphs:`` line. Before ``wrap``: DDP lays its gradient buckets
        out after the parameters' format. A plug-in model under ``auto`` keeps channels_last
        only if its forward of ``example()`` (one training input) runs in it; the built-in
        models are known to."""
        plugin = registry.is_plugin(self.cfg.model)
        return speed_up(
            net,
            optimizer,
            memory_format=self.cfg.memory_format,  # type: ignore[arg-type]  # MEMORY_FORMATS
            fused=self.cfg.fused_optimizer,
            example=example if plugin else None,  # called only where the trial runs
            log=log.info,
        )

    def build(
        self,
        net: torch.nn.Module,
        make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
        example: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.memory_format]:
        """(the model the step runs, its optimizer, the inputs' memory format): ``speed_up``
        first (the layout and the fused kernel), then ``wrap``."""
        sped = self.speed_up(net, make_optimizer(net.parameters()), example)
        return self.wrap(net), sped.optimizer, sped.memory_format

    @staticmethod
    def feed(
        memory_format: torch.memory_format, train: TrainData, test: EvalData
    ) -> tuple[TrainData, EvalData]:
        """The data, giving batches in the model's memory format where it lays them out itself
        (the GPU-resident path: the first convolution then converts nothing); a loader's
        batches are converted by the model's first convolution."""
        for data in (train, test):
            if isinstance(data, (GpuTrainData, GpuEvalData)):
                data.use_memory_format(memory_format)
        return train, test

    def wrap(self, net: torch.nn.Module) -> torch.nn.Module:
        """What the step runs: DDP(net) where DDP averages, else ``net`` itself."""
        if self.sync != "ddp":
            return net
        one = len(self.ctx.devices) == 1
        ids = [self.ctx.device] if self.ctx.device.type == "cuda" and one else None
        return DDP(net, device_ids=ids, **ddp_options(net, one_device=one))

    def stepper(
        self,
        net: torch.nn.Module,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        out_device: torch.device,
    ) -> Stepper:
        """The step runner: the captured step, or the eager one with its gradient average."""
        amp = self.amp
        if self.captured:
            return cuda_graphs.GraphedStepper(net, optimizer, scheduler, scaler, amp, out_device)
        stepper = Stepper(model, optimizer, scheduler, scaler, amp, out_device)
        if self.sync == "per_tensor":
            stepper.averager = PerTensorAverage(net, sync_buffers=training_reads_buffers(net))
        if isinstance(model, DDP):
            # DDP over Gloo (only where gradient_sync is overridden, as tests comparing with DDP
            # do) reduces per tensor in a hook, as PerTensorAverage does: bit-exact resume at
            # any world size. NCCL keeps DDP's flat buckets and its C++ all-reduce unless timed
            # (a Python hook per bucket costs host time on every step: benchmarks/NOTES.md).
            gloo = self.ctx.backend == "gloo"
            stepper.comm_timer.per_tensor = gloo
            if gloo or self.cfg.time_allreduce:
                model.register_comm_hook(stepper.comm_timer, timed_allreduce)
        return stepper

    def share_with(self, stepper: Stepper, run: Resumable) -> None:
        """No background save overlaps a graph's capture, nor evaluation's recording."""
        if isinstance(stepper, cuda_graphs.GraphedStepper):
            stepper.graphed.before_capture = run.wait
            stepper.evaluation.may_record = lambda: not run.in_flight


def plan_step(
    cfg: TrainConfig, ctx: DistContext, amp: torch.dtype | None, world_size: int
) -> StepPlan:
    """The step this run takes, said once (the ``CUDA graphs:`` line)."""
    choice = cuda_graphs.choose(cfg, ctx.device, amp, len(ctx.devices))
    log.info(choice.line)
    sync = gradient_sync(ctx.backend, world_size, choice.captured)
    return StepPlan(cfg, ctx, amp, choice.captured, sync)


class StartUp:
    """What runs beside the process group's start: CUDA's one-time costs (kernels, libraries)
    and the torch._dynamo import, each on a thread, where the run will need them."""

    def __init__(self, warmup: KernelWarmup | None, prefetch: DynamoPrefetch | None) -> None:
        self.warmup, self.prefetch = warmup, prefetch

    @classmethod
    def begin(cls, config: TrainConfig, env: DistEnv, *, joining: bool) -> StartUp:
        """Start both threads; ``joining``: this process starts the process group next (the
        kernel warm-up only overlaps that)."""
        prefetch = DynamoPrefetch.start() if needs_dynamo(config, env) else None
        warmup = KernelWarmup.start(config, env) if joining else None
        return cls(warmup, prefetch)

    def joined(self) -> None:
        """The process group's start returned (or failed): the warm-up is waited for."""
        if self.warmup is not None:
            self.warmup.finish()

    def process_group_ready(self) -> None:
        if self.prefetch is not None:
            self.prefetch.process_group_ready()
