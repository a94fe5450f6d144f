"""Evaluation as CUDA graph replays, for runs whose training step is captured.

Why: an evaluation batch of a small model is a few dozen short kernels, and eager PyTorch takes
longer to launch them from the host than the GPU takes to run them: over an epoch's evaluation,
a noticeable share of a steady small-model epoch in which the GPU mostly waits
(benchmarks/NOTES.md). A replay launches a batch's kernels with one call.

The same numbers as ``evaluation.accumulate``: a batch runs ``EvalSums.add_batch`` whether eager or
recorded, adding into running sums that live at fixed addresses, in batch order. Each batch shape is
run eagerly once (on a side stream, as ``torch.cuda.graph`` asks of warm-up work), recorded at its
second batch, and replayed from then on (at most ``MAX_RECORDED`` shapes; others stay eager); the
capture runs nothing, so every batch is counted once. No recording starts while a background
checkpoint save runs (CUDA would refuse its pinned copies); the batch runs eagerly instead. A
forward that cannot be recorded (one reading a value on the host) runs eagerly, said once in the
log. The model's parameters and buffers are read where they live: the optimizer updates them in
place and checkpoints restore them in place, so a graph recorded in epoch 1 evaluates the weights of
every later epoch.

The graphs share the training step's memory pool when it has one: neither graph reads the
other's temporaries and they never run at once (one stream), so evaluation holds no memory of
its own beyond its inputs and sums.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hpc_ddp import CapturedStep, EvalSums
from hpc_ddp.log import get_logger

if TYPE_CHECKING:
    from hpc_ddp.runtime.evaluation import Batches

log = get_logger("train")

Shape = tuple[tuple[int, ...], tuple[int, ...], torch.dtype, torch.dtype]
# Recorded shapes at most: a fixed-size test set has two (the batch and the short last one);
# inputs of many sizes (sequences, say) would otherwise record a graph for each.
MAX_RECORDED = 4


@dataclass
class _Recorded:
    graph: torch.cuda.CUDAGraph
    x: torch.Tensor
    y: torch.Tensor


class GraphedEval:
    """``accumulate(model, batches, amp_dtype)`` like ``evaluation.accumulate``, for ``model`` on
    one CUDA device, replaying a recorded graph per batch shape. ``pool`` returns the memory pool
    to share (the training step's), or None; ``may_record`` says whether recording is safe now.
    Call ``release`` before the model goes."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        pool: Callable[[], object] | None = None,
        may_record: Callable[[], bool] = lambda: True,
    ) -> None:
        self.model = model
        self.device = device
        self.pool = pool
        # False while another thread may call CUDA: a recording in progress makes CUDA refuse
        # other threads' pinned allocations (a background checkpoint save copying to the host).
        # The batch then runs eagerly and its shape is recorded at a later evaluation.
        self.may_record = may_record
        self.sums = EvalSums.zeros(device)  # the graphs add into these
        self.warmed: set[Shape] = set()
        self.eager_only: set[Shape] = set()
        self.recorded: dict[Shape, _Recorded] = {}
        self.replays = 0
        self.side: torch.cuda.Stream | None = None  # eager batches: warm-up stays off the main

    def accumulate(
        self, model: nn.Module, batches: Batches, amp_dtype: torch.dtype | None
    ) -> EvalSums:
        """This rank's sums over ``batches`` (valid until the next call: they are overwritten)."""
        if model is not self.model:
            raise ValueError("GraphedEval records one model; evaluate that one")
        self.sums.loss.zero_()
        self.sums.correct.zero_()
        count = 0
        for x, y in batches:
            recorded = self._recorded(x, y, amp_dtype)
            if recorded is None:  # a shape's first batch, or one that cannot be recorded
                self._eager(x, y, amp_dtype)
            else:
                recorded.x.copy_(x)
                recorded.y.copy_(y)
                recorded.graph.replay()
                self.replays += 1
            count += len(y)
        self.sums.count = count
        return self.sums

    def _recorded(
        self, x: torch.Tensor, y: torch.Tensor, amp_dtype: torch.dtype | None
    ) -> _Recorded | None:
        """The graph for this batch's shape: None at its first batch (run eagerly, as warm-up)
        or where recording failed; recorded at its second."""
        shape: Shape = (tuple(x.shape), tuple(y.shape), x.dtype, y.dtype)
        if shape in self.recorded or shape in self.eager_only:
            return self.recorded.get(shape)
        if shape not in self.warmed:
            self.warmed.add(shape)
            return None
        if not self.may_record():
            return None
        if len(self.recorded) >= MAX_RECORDED:
            self.eager_only.add(shape)
            return None
        try:
            self.recorded[shape] = self._record(x, y, amp_dtype)
        except RuntimeError as err:  # e.g. a forward that reads a value on the host
            self.eager_only.add(shape)
            log.warning(f"evaluation runs eagerly: its forward cannot be captured ({err})")
            return None
        return self.recorded[shape]

    def _eager(self, x: torch.Tensor, y: torch.Tensor, amp_dtype: torch.dtype | None) -> None:
        main = torch.cuda.current_stream(self.device)
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):
            self.sums.add_batch(self.model, x, y, amp_dtype)
        main.wait_stream(self.side)

    def _record(self, x: torch.Tensor, y: torch.Tensor, amp_dtype: torch.dtype | None) -> _Recorded:
        recorded = _Recorded(torch.cuda.CUDAGraph(), torch.empty_like(x), torch.empty_like(y))
        pool = self.pool() if self.pool is not None else None
        with CapturedStep.record(recorded.graph, pool=pool):
            self.sums.add_batch(self.model, recorded.x, recorded.y, amp_dtype, cast_cache=False)
        return recorded

    def release(self) -> None:
        for recorded in self.recorded.values():
            recorded.graph.reset()
        self.recorded.clear()
