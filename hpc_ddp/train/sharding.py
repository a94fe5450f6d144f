"""``--fsdp``: the model sharded over the processes with FSDP2 (``fully_shard``) instead of DDP.

What it changes:

- the model: ``fully_shard`` on each block, then on the root. The blocks are the top-level
  stages of a ``torch.nn.Sequential`` that hold parameters (the registry's models are
  Sequentials: LeNet's 5 layers, ResNet-18's stem, 4 stages and head); any other model, or one
  whose stages share a parameter, is one unit (the root alone). Each rank keeps a shard of every
  weight, of its gradient and of its optimizer state; a block's weights are gathered for its
  forward and its backward, its gradients reduce-scattered: averaged over the ranks as DDP's
  all-reduce averages them. With bf16 (a GPU's default ``amp``) a ``MixedPrecisionPolicy``
  gathers and computes in bf16 and reduces gradients in fp32; on a CPU everything is fp32.
- evaluation: exact as always (every test sample counted once, ``eval_indices``), but every
  rank must run as many forwards as the others, since each forward gathers weights with them.
  The ranks agree before each batch whether any has one left (a small all-reduce and a host
  read per batch); a rank with none left runs its last batch again, uncounted.
- checkpoints: ``hpc_ddp.Resumable`` sees the DTensors and writes sharded checkpoints through
  ``torch.distributed.checkpoint`` (every rank its shards), which load on any number of ranks.
  BatchNorm statistics (buffers) are not sharded and each rank updates its own, as under DDP
  without its broadcast: rank 0's reach every rank before each evaluation (as with DDP) and
  before each save (resume.py), so checkpoints and the weights' fingerprint hold rank 0's.

What it keeps: the step (``loop.Stepper``: accumulation, autocast, the loss), the data and its
order (every rank the same number of steps: ``ShardPlan`` pads each rank's share to equal
length, also after a resume on another number of ranks), the schedule, exact resume.
What it refuses (``config.fsdp_problems``, and :func:`check_devices` before the run directory
is touched): captured steps, fp16 with its loss scaler, SyncBatchNorm, DDP's all-reduce timing, a
process driving several GPUs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from hpc_ddp import Comm, EvalSums
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train.fast import cuda_graphs
from hpc_ddp.train.loop import Stepper

if TYPE_CHECKING:
    from hpc_ddp import DistContext, Resumable
    from hpc_ddp.runtime.evaluation import Batches
    from hpc_ddp.train.config import TrainConfig

log = get_logger("train")


def blocks(net: nn.Module) -> list[nn.Module]:
    """The units sharded on their own before the root (see the module docstring)."""
    if not isinstance(net, nn.Sequential):
        return []
    stages = [m for m in net.children() if next(m.parameters(), None) is not None]
    ids = [id(p) for m in stages for p in m.parameters()]
    return stages if len(ids) == len(set(ids)) else []


@dataclass
class FsdpStepper(Stepper):
    """The eager step on a ``fully_shard`` model, and evaluation with as many forwards on
    every rank."""

    comm: Comm | None = None

    def accumulating(self) -> contextlib.AbstractContextManager[Any]:
        """A micro-batch that is not its step's last keeps its gradients unreduced (the last
        one reduces them all, as DDP's ``no_sync``)."""
        return _no_gradient_sync(self.model)

    def eval_sums(
        self, model: nn.Module, batches: Batches, amp_dtype: torch.dtype | None
    ) -> EvalSums:
        assert self.comm is not None
        if self.comm.world_size == 1:  # no one to keep pace with
            return super().eval_sums(model, batches, amp_dtype)
        sums = EvalSums.zeros(self.out_device)
        last: tuple[torch.Tensor, torch.Tensor] | None = None
        it = iter(batches)
        first = True
        while True:
            batch = next(it, None)
            having = int(self.comm.sum([float(batch is not None)])[0])  # ranks with a batch
            if first and 0 < having < self.comm.world_size:
                raise ConfigError(
                    f"{self.comm.world_size - having} of {self.comm.world_size} ranks have no "
                    "test sample: with --fsdp every rank must evaluate (its forwards gather "
                    "the weights with the others)",
                    hint="give the test split at least as many samples as there are processes",
                )
            first = False
            if not having:
                return sums
            if batch is None:  # the others still evaluate: the same forward, not counted
                assert last is not None
                EvalSums.zeros(self.out_device).add_batch(model, *last, amp_dtype)
                continue
            sums.add_batch(model, *batch, amp_dtype)
            sums.count += len(batch[1])
            last = batch


@contextlib.contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


@dataclass(frozen=True)
class ShardedStep:
    """The trainer's ``StepPlan`` for an FSDP2 run: never captured, the model sharded."""

    cfg: TrainConfig
    ctx: DistContext
    amp: torch.dtype | None
    captured: bool = False

    def wrap(self, net: nn.Module) -> nn.Module:
        """``net`` sharded in place (its parameters become DTensors); build the optimizer
        after this, from its parameters."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Over this process's device, which FSDP2's default (the host's accelerator) is not
        # for a CPU process on a GPU host; one mesh for every unit.
        world = self.ctx.env.world_size
        kwargs: dict[str, Any] = {"mesh": init_device_mesh(self.ctx.device.type, (world,))}
        if self.amp is not None:
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=self.amp, reduce_dtype=torch.float32
            )
        units = blocks(net)
        for block in units:
            fully_shard(block, **kwargs)
        fully_shard(net, **kwargs)
        log.info(parallelism_line(len(units), self.amp))
        return net

    def build(
        self,
        net: nn.Module,
        make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
        example: Callable[[], torch.Tensor] | None = None,
    ) -> tuple[nn.Module, torch.optim.Optimizer, torch.memory_format]:
        """(the model sharded in place, its optimizer over the shards, the inputs' memory
        format): the optimizer is built after sharding, from the DTensor parameters; the
        layout is the sharding's (``hpc_ddp.speed_up`` leaves a sharded model as given)."""
        model = self.wrap(net)
        return model, make_optimizer(net.parameters()), torch.contiguous_format

    @staticmethod
    def feed(_memory_format: torch.memory_format, train: Any, test: Any) -> tuple[Any, Any]:
        """The data as it comes: no layout of its own to take."""
        return train, test

    def stepper(
        self,
        net: nn.Module,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        out_device: torch.device,
    ) -> Stepper:
        comm = Comm(self.ctx.device)
        return FsdpStepper(model, optimizer, scheduler, scaler, self.amp, out_device, comm=comm)

    def share_with(self, stepper: Stepper, run: Resumable) -> None:
        """Nothing to share: no graph is captured."""


def check_devices(ctx: DistContext) -> None:
    """Refuse a process that drives several GPUs (``env_vars.GPUS_PER_PROCESS_VAR``, the
    one-process-per-node layout: known only once the process runs; the flag is refused with
    the other settings, ``config.fsdp_problems``)."""
    if len(ctx.devices) > 1:
        raise ConfigError(
            f"--fsdp cannot run with one process driving {len(ctx.devices)} GPUs "
            "(gpus_per_process): FSDP2 shards over processes of one GPU each",
            hint="start one process per GPU (--gpus-per-process 1, or a per-GPU layout), or "
            "drop --fsdp",
        )


def plan_step(cfg: TrainConfig, ctx: DistContext, amp: torch.dtype | None) -> ShardedStep:
    """The step of an FSDP2 run, said in two lines (``CUDA graphs:``, ``parallelism:``)."""
    check_devices(ctx)
    log.info(cuda_graphs.choose(cfg, ctx.device, amp, len(ctx.devices)).line)
    return ShardedStep(cfg, ctx, amp)


def parallelism_line(blocks: int, amp: torch.dtype | None) -> str:
    """The start-up line that says how the model is spread over the processes."""
    units = (
        f"fully_shard per block: {blocks} blocks, then the root"
        if blocks
        else "fully_shard on the root"
    )
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    precision = (
        f"mixed precision {names.get(amp, str(amp))} (gradients reduced in fp32)"
        if amp is not None
        else "fp32"
    )
    return f"parallelism: FSDP2 ({units}), {precision}"
