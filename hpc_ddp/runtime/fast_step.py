"""``speed_up(model, optimizer)``: the layout and kernels that make a training step fast on a GPU.

Two choices that eager PyTorch leaves at their slow defaults, and that the built-in trainer
takes too (through this function):

- the channels_last memory format for a model with 2-D convolutions: cuDNN's convolutions are
  written for NHWC, so under bf16/fp16 an NCHW model pays a layout transform around every
  convolution (benchmarks/NOTES.md has a ResNet-18 step with and without);
- the optimizer's fused CUDA kernel (SGD, Adam, AdamW): one launch per step for all parameters,
  where the default multi-tensor kernels take several per group of tensors.

Neither changes what is computed, only the rounding: a run with them is not bit-identical to one
without (a run and its resumed twin still are). Both are only taken on a CUDA device; on a CPU
the model and optimizer come back unchanged.

The fused flag is how the optimizer computes, not what it learnt: a checkpoint of the fused
optimizer is written as an unfused one (``fused``/``foreach`` left to the loader), and the fused
optimizer keeps its kernel when it loads a checkpoint of an unfused one, so checkpoints move
between scripts that use ``speed_up`` and scripts that do not, in both directions.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn

from hpc_ddp.dtensors import any_dtensor
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger

MEMORY_FORMATS = ("auto", "channels_last", "contiguous")
# cuDNN's NHWC tensor-core kernels want channel counts that are multiples of this; a network
# with narrower convolutions (LeNet's 6 and 16) steps faster in NCHW, so auto leaves it there.
TENSOR_CORE_CHANNELS = 8
# The device types where both choices pay (tests running on a CPU stand in for a GPU here).
FAST_DEVICES = ("cuda",)
MemoryFormat = Literal["auto", "channels_last", "contiguous"]
# The optimizers whose fused kernel runs on CUDA for every floating-point parameter.
FUSED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
# The implementation flags a checkpoint leaves to its loader (see the module docstring).
_KERNEL_FLAGS = ("fused", "foreach")


class SpeedUp(tuple):
    """``speed_up``'s answer: unpacks as ``(model, optimizer)``; ``line`` says what was chosen
    (``"step: channels_last (20 Conv2d), fused SGD"``), ``memory_format`` is the model's (give
    4-D inputs this format to spare the first convolution a conversion), ``channels_last`` and
    ``fused`` say whether each was taken, ``on_gpu`` whether the model is on a CUDA device
    (where ``auto`` and ``fused`` act)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    line: str
    memory_format: torch.memory_format
    channels_last: bool
    fused: bool
    on_gpu: bool

    def __new__(cls, model: nn.Module, optimizer: Any, **choice: Any) -> SpeedUp:
        self = super().__new__(cls, (model, optimizer))
        self.model, self.optimizer = model, optimizer
        self.__dict__.update(choice)
        return self


def speed_up(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    memory_format: MemoryFormat = "auto",
    fused: bool = True,
    example: torch.Tensor | Callable[[], torch.Tensor] | None = None,
    log: Callable[[str], object] | None = None,
) -> SpeedUp:
    """The model in channels_last and the optimizer rebuilt with its fused kernel, on a CUDA
    device; ``model, optimizer = hpc_ddp.speed_up(model, optimizer)``.

    Call it once the model is on its device and the optimizer is built, before anything else
    holds them: before ``DDP(model)`` (DDP lays its gradient buckets out after the parameters),
    before an LR scheduler or ``Resumable`` takes the optimizer, before the first step. The
    model is converted in place (the same object comes back, its parameters the same objects);
    the optimizer is a new one over the same parameter groups and hyper-parameters.

    ``memory_format``: ``auto`` takes channels_last for a model with ``nn.Conv2d`` layers on a
    CUDA device whose output channels are all multiples of 8 (tensor-core NHWC kernels; narrower
    ones, as LeNet's, step faster in NCHW); ``channels_last`` takes it on any device;
    ``contiguous`` never. ``fused``: take the fused kernel of SGD, Adam or AdamW where every
    parameter is a floating-point CUDA tensor (``False`` keeps the optimizer as given). A model
    sharded into DTensors (FSDP2's ``fully_shard``) is left as given. ``example``: an input
    batch of the model (one sample will do), or a function returning one (called only if the
    trial runs); under ``auto``, channels_last is kept only if the model's forward of it runs in
    that format (code written for NCHW activations, such as ``x.view(len(x), -1)`` on a feature
    map, fails on channels_last ones), run once in eval mode without gradients, so neither the
    weights nor a normalization layer's statistics change. ``log``: where the one-line answer
    goes (default: the ``hpc_ddp`` logger, rank 0's line). Raises ``ConfigError`` for a wrapped
    model, an optimizer that already stepped or has a scheduler, or an unknown
    ``memory_format``.
    """
    if memory_format not in MEMORY_FORMATS:
        raise ConfigError(
            f"memory_format={memory_format!r} is not valid",
            hint=f"use one of {', '.join(MEMORY_FORMATS)}",
        )
    _refuse_wrapped(model)
    if optimizer is not None:
        _refuse_started(optimizer)
    on_cuda = _device_type(model) in FAST_DEVICES
    sharded = _sharded(model)
    conv_layers = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    convs = len(conv_layers)
    narrow = sum(m.out_channels % TENSOR_CORE_CHANNELS != 0 for m in conv_layers)
    layout = torch.contiguous_format
    if not sharded:
        layout = _choose_layout(memory_format, on_cuda=on_cuda, convs=convs, narrow=narrow)
    words = None
    if layout == torch.channels_last:
        model.to(memory_format=torch.channels_last)
        failure = None
        if example is not None and memory_format == "auto":
            failure = _fails_in_channels_last(model, example() if callable(example) else example)
        if failure is not None:
            model.to(memory_format=torch.contiguous_format)
            layout = torch.contiguous_format
            words = f"contiguous (its forward fails in channels_last: {failure})"
    parts = [words or _layout_words(layout, memory_format, convs, narrow)]
    took_fused = False
    if optimizer is not None and not sharded:
        optimizer, took_fused, words = _fuse(optimizer, wanted=fused, on_cuda=on_cuda)
        parts.append(words)
    if sharded:
        line = "step: as given (a sharded model: its parameters are DTensors)"
    elif not on_cuda and layout != torch.channels_last:
        line = f"step: as given (the model is on {_device_type(model)}, not a CUDA device)"
    else:
        line = "step: " + ", ".join(parts)
    (log or get_logger().info)(line)
    return SpeedUp(
        model,
        optimizer,
        line=line,
        memory_format=layout,
        channels_last=layout == torch.channels_last,
        fused=took_fused,
        on_gpu=on_cuda,
    )


def _fails_in_channels_last(model: nn.Module, example: torch.Tensor) -> str | None:
    """Why the model's forward of ``example`` fails in channels_last, or None if it runs."""
    first = next(iter(model.parameters()), None)
    x = example.to(first.device if first is not None else example.device)
    if x.dim() == 4:
        x = x.to(memory_format=torch.channels_last)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(x)
    except RuntimeError as exc:  # a view of NCHW strides, an op without an NHWC path
        said = str(exc).strip().splitlines()
        return (said[0] if said else type(exc).__name__)[:160]
    finally:
        model.train(was_training)
    return None


def _device_type(model: nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return first.device.type if first is not None else "cpu"


def _sharded(model: nn.Module) -> bool:
    """The model's parameters are DTensors (FSDP2's ``fully_shard``, tensor parallelism): their
    layout and the optimizer's kernel are the sharding's to choose, not this function's."""
    return any_dtensor(model.parameters())


def _refuse_wrapped(model: nn.Module) -> None:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    if isinstance(model, (DataParallel, DistributedDataParallel)):
        raise ConfigError(
            f"speed_up was given a {type(model).__name__}-wrapped model",
            hint="call speed_up(model, optimizer) before wrapping the model "
            f"({type(model).__name__} lays its gradient buffers out after the parameters' format)",
        )


def _refuse_started(optimizer: torch.optim.Optimizer) -> None:
    name = type(optimizer).__name__
    if optimizer.state:
        raise ConfigError(
            f"speed_up was given a {name} that already has state (it stepped, or loaded a "
            "checkpoint): rebuilding it would lose that state",
            hint="call speed_up(model, optimizer) right after building the optimizer, before "
            "the first step and before Resumable or a checkpoint restores into it",
        )
    if any("initial_lr" in group for group in optimizer.param_groups):
        raise ConfigError(
            f"speed_up was given a {name} that an LR scheduler already holds: the scheduler "
            "would go on setting the learning rate of the optimizer speed_up replaces",
            hint="build the LR scheduler after speed_up(model, optimizer), on the optimizer "
            "it returns",
        )


def _choose_layout(asked: str, *, on_cuda: bool, convs: int, narrow: int) -> torch.memory_format:
    if asked == "contiguous" or not convs:
        return torch.contiguous_format
    if asked == "auto" and (not on_cuda or narrow):
        return torch.contiguous_format
    return torch.channels_last


def _layout_words(layout: torch.memory_format, asked: str, convs: int, narrow: int) -> str:
    if layout == torch.channels_last:
        return f"channels_last ({convs} Conv2d)"
    if not convs:
        return "contiguous (no Conv2d)"
    if asked == "auto" and narrow:
        multiple = f"{TENSOR_CORE_CHANNELS}-channel multiples"
        return f"contiguous ({narrow} of {convs} Conv2d narrower than {multiple})"
    return f"contiguous (memory_format={asked})"


def _fuse(
    optimizer: torch.optim.Optimizer, *, wanted: bool, on_cuda: bool
) -> tuple[torch.optim.Optimizer, bool, str]:
    """(the optimizer to use, whether it is fused, its words for the line)."""
    name = type(optimizer).__name__
    if not wanted:
        return optimizer, False, f"{name} as given (fused off)"
    if not isinstance(optimizer, FUSED_OPTIMIZERS):
        return optimizer, False, f"{name} as given (no fused CUDA kernel)"
    if type(optimizer).__init__ not in {cls.__init__ for cls in FUSED_OPTIMIZERS}:
        return optimizer, False, f"{name} as given (its own constructor: pass it fused=True)"
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not on_cuda:
        return optimizer, False, f"{name} as given (no CUDA device)"
    if not all(p.device.type in FAST_DEVICES and p.is_floating_point() for p in params):
        return optimizer, False, f"{name} as given (fused needs floating-point CUDA parameters)"
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return optimizer, False, f"{name} as given (differentiable: no fused kernel)"
    fused = _rebuild_fused(optimizer)
    return fused, True, f"fused {name}"


def _rebuild_fused(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The same class over the same groups and hyper-parameters, with ``fused=True``."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kernel = {"fused": True, "foreach": None}
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    groups = [{**group, **kernel} for group in optimizer.param_groups]
    fused = cls(groups, **{**defaults, **kernel})
    fused.register_state_dict_post_hook(_saved_without_kernel)
    fused.register_load_state_dict_post_hook(_keep_fused)
    return fused


def _saved_without_kernel(
    _optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """A checkpoint leaves the kernel to whoever loads it (torch's load adopts the saved flags)."""
    for group in state_dict["param_groups"]:
        group.update(dict.fromkeys(_KERNEL_FLAGS))
    return state_dict


def _keep_fused(optimizer: torch.optim.Optimizer) -> None:
    """After a load: the fused kernel again, and its state where and as it reads it."""
    for group in optimizer.param_groups:
        group.update(fused=True, foreach=None)
    lay_out_state(optimizer)


def lay_out_state(optimizer: torch.optim.Optimizer) -> None:
    """Each state tensor where and as a fused kernel reads it. The kernel walks a parameter, its
    gradient and its state as flat memory, so a state tensor of the parameter's shape must have
    its strides (a checkpoint of a contiguous model holds NCHW momentum for a channels_last
    weight), and every state tensor must be on the parameter's device (an unfused Adam keeps
    ``step`` on the CPU, as float32 where the fused kernel reads it)."""
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.device != param.device:
                dtype = torch.float32 if key == "step" else value.dtype
                state[key] = value = value.to(device=param.device, dtype=dtype)
            if value.shape == param.shape and value.stride() != param.stride():
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)
