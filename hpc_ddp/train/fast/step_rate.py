"""Whether a GPU run's step is bound by kernel latency rather than arithmetic, said once.

A small model's step is a fixed chain of short kernels (LeNet's captured step: ~90 kernels for
0.25 GFLOP at 64 samples per GPU, far below a datacenter GPU's rate: benchmarks/NOTES.md). Where
a step computes at under 2 TFLOP/s on a GPU that does tens, arithmetic is a few percent of it at
most: a smaller batch per GPU would barely shorten it, so spreading the same global batch over
more GPUs does not shorten the run, while a larger batch per GPU would use them. The trainer
counts the model's arithmetic once (forward hooks on its convolutions and linear layers while
the first evaluation runs eagerly), times the steady step (the attempt's second epoch), and says
so.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

# FLOP/s under which a step cannot be arithmetic-bound on a datacenter GPU: current ones do tens
# of TFLOP/s in fp32 without tensor cores, and a captured ResNet-18 bf16 step reaches tens.
LATENCY_BOUND_FLOPS = 2e12
BACKWARD_FACTOR = 3  # forward + backward: the backward pass costs about twice the forward


class ForwardFlops:
    """Multiply-add FLOPs per sample of one forward through ``nn.Conv*`` and ``nn.Linear``
    modules (each module's first call, so several batches count once); other operations, far
    cheaper in such models, are not counted."""

    def __init__(self) -> None:
        self.per_sample = 0.0
        self._seen: set[int] = set()

    @contextlib.contextmanager
    def counting(self, model: nn.Module) -> Iterator[ForwardFlops]:
        handles = [
            m.register_forward_hook(self._hook)
            for m in model.modules()
            if isinstance(m, nn.Linear | nn.modules.conv._ConvNd)
        ]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, module: nn.Module, inputs: object, output: object) -> None:
        if id(module) in self._seen or not isinstance(output, torch.Tensor) or output.dim() < 2:
            return
        self._seen.add(id(module))
        outputs_per_sample = output[0].numel()
        if isinstance(module, nn.Linear):
            macs = outputs_per_sample * module.in_features
        else:
            conv: nn.modules.conv._ConvNd = module  # type: ignore[assignment]
            macs = outputs_per_sample * conv.in_channels // conv.groups
            macs *= math.prod(conv.kernel_size)
        self.per_sample += 2 * macs


def latency_bound_line(flops_per_sample: float, samples_per_step: int, step_s: float) -> str | None:
    """The line to log when a step of ``samples_per_step`` samples per GPU, taking ``step_s``,
    computes at under ``LATENCY_BOUND_FLOPS``; None otherwise (or when nothing was counted)."""
    step_flops = BACKWARD_FACTOR * flops_per_sample * samples_per_step
    if step_flops <= 0 or step_s <= 0:
        return None
    rate = step_flops / step_s
    if rate >= LATENCY_BOUND_FLOPS:
        return None
    return (
        f"step: {1e3 * step_s:.2f} ms for {step_flops / 1e9:.2f} GFLOP per GPU "
        f"({rate / 1e12:.2f} TFLOP/s): bound by kernel latency, not arithmetic. A smaller "
        "batch per GPU would barely shorten it, so the same global batch on more GPUs would not "
        "train faster; a larger batch per GPU would use them"
    )


class LatencyAdvice:
    """The trainer's use of the above, on GPU runs: count during the attempt's first evaluation,
    judge the attempt's second epoch (the first carries CUDA's first use of every kernel), once.
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.flops = ForwardFlops()
        self.epochs = 0

    def evaluating(self, model: nn.Module) -> AbstractContextManager[object]:
        if self.enabled and self.epochs == 0:
            return self.flops.counting(model)
        return nullcontext()

    def epoch_ended(self, compute_s: float, steps: int, samples_per_step: int) -> str | None:
        """The line to log after this epoch, if any (``compute_s``: its steps' seconds)."""
        self.epochs += 1
        if not self.enabled or self.epochs != 2 or steps <= 0:
            return None
        return latency_bound_line(self.flops.per_sample, samples_per_step, compute_s / steps)
