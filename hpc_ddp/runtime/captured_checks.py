"""What ``CapturedStep`` accepts (``ConfigError`` with a hint otherwise), and where it steps eagerly
instead of replaying a graph (the one line it logs says why)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from hpc_ddp.dtensors import any_dtensor
from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.capturable import why_not_capturable
from hpc_ddp.runtime.grad_buckets import dense

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
AMP_DTYPES = (None, torch.bfloat16, torch.float16)
MAX_ACCUM_STEPS = 1 << 16
MAX_WARMUP = 1000


def why_eager(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    amp_dtype: torch.dtype | None,
    world_size: int,
    allreduce_in_graph: bool,
    capture: bool,
    one_buffer: str | None,
) -> str | None:
    """Why a step of these cannot be captured (it then runs eagerly), or None; ``one_buffer``:
    why the gradients cannot share one buffer (``why_not_one_buffer``), or None."""
    if not capture:
        return "capture=False"
    if device.type != "cuda":
        return f"the model is on {device.type}, not a CUDA GPU"
    if one_buffer is not None:
        return one_buffer
    if amp_dtype == torch.float16:
        return "amp_dtype=float16: its loss scaling checks for inf on the host (bf16 needs none)"
    why = why_not_capturable(optimizer)
    if why is not None:
        return why
    if any(isinstance(m, nn.SyncBatchNorm) for m in model.modules()):
        return "SyncBatchNorm: its statistics' all-gather is not captured"
    if world_size > 1 and allreduce_in_graph and dist.get_backend() != "nccl":
        return f"the process group's backend is {dist.get_backend()}: only NCCL's is captured"
    return None


def why_not_one_buffer(params: list[nn.Parameter]) -> str | None:
    """Why the gradients cannot share one flat buffer (which a graph needs), or None."""
    devices = {p.device for p in params}
    if len(devices) > 1:
        return f"the parameters are on {len(devices)} devices: a graph drives one"
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        return f"the parameters have {len(dtypes)} dtypes: the gradient buffer holds one"
    if not all(dense(p) for p in params):
        return "a parameter is a strided view: the gradient buffer needs dense tensors"
    return None


def refuse_bad_input(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn | None,
    amp_dtype: torch.dtype | None,
    accum_steps: int,
    warmup: int,
) -> None:
    """``ConfigError`` for what no step, captured or eager, could run as DDP would: a wrapped or
    sharded model, an optimizer over other tensors, LBFGS (it steps with a closure), settings
    out of range (``warmup`` >= 1: the optimizer makes its state in its first step, which a
    graph must not record)."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DataParallel, DistributedDataParallel)):
        raise ConfigError(
            f"CapturedStep was given a {type(model).__name__}-wrapped model",
            hint="pass the bare model: CapturedStep averages the gradients itself (it replaces "
            "DDP(model))",
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ConfigError("the model has no trainable parameters", hint="pass the model you train")
    if any_dtensor(trainable):
        raise ConfigError(
            "the model is sharded into DTensors (FSDP2): FSDP reduces its gradients itself",
            hint="step an FSDP2 model as FSDP2 does, without CapturedStep",
        )
    ids = {id(p) for p in model.parameters()}  # frozen ones too: no gradient, skipped
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in ids]
    if foreign:
        raise ConfigError(
            f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of the model",
            hint="build the optimizer over model.parameters() (after speed_up, its answer)",
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ConfigError("LBFGS steps with a closure", hint="use another optimizer, or DDP")
    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn={loss_fn!r} is not callable", hint="pass loss_fn(out, y)")
    if amp_dtype not in AMP_DTYPES:
        raise ConfigError(
            f"amp_dtype={amp_dtype} is not supported", hint="use torch.bfloat16, float16 or None"
        )
    for name, value, most in (
        ("accum_steps", accum_steps, MAX_ACCUM_STEPS),
        ("warmup", warmup, MAX_WARMUP),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ConfigError(
                f"{name}={value!r} is out of range", hint=f"use a whole number from 1 to {most}"
            )
