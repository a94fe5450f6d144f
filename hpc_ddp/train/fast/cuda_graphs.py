"""``--cuda-graphs``: one training step (forward, backward, gradient all-reduce, optimizer) as a
CUDA graph replayed once per micro-batch.

Why: a small model such as LeNet needs little arithmetic per step, but eager PyTorch spends many
times as long launching its ~100 kernels from Python (DDP hooks, autograd, the optimizer's loops;
benchmarks/NOTES.md). A graph replay launches all of them with one call, so the GPU, not the CPU,
sets the pace.

Same semantics as the eager DDP step, which is what makes it safe as an option:
- gradients are averaged over ranks exactly as DDP does (sum of per-rank gradients / world size),
  over a flat gradient buffer that the parameters' ``.grad`` views point into (DDP's
  ``gradient_as_bucket_view``), bucket by bucket while backward runs, as DDP overlaps them
  (``grad_buckets``), captured inside the graph;
- rank 0's parameters and buffers are broadcast at start, as DDP's constructor does;
- every micro-batch is trained on exactly once: the first ``warmup`` steps run eagerly (on a side
  stream, to settle cuBLAS/cuDNN workspaces, NCCL communicators and the optimizer's state), the
  graph is captured on the next one and replayed from then on, and capture itself runs nothing;
- the learning rate becomes a 1-element device tensor (Adam's ``capturable`` mode and SGD's
  fused kernel read it on the GPU), so LR schedulers keep working: they ``fill_`` it in place;
- autocast (bf16) runs inside the graph with its cast cache off, as PyTorch requires for graphs.
Limits: Adam/AdamW or SGD (SGD through its fused kernel: the multi-tensor one reads a tensor LR
on the host), no fp16 loss scaling (its inf check syncs with the host), no gradient
accumulation, no SyncBN, one CUDA GPU per process. ``choose`` applies them: by default
(``cuda_graphs="auto"``) a run that meets them is captured and any other runs eager DDP, saying
why in one log line; ``--cuda-graphs`` (``on``) refuses such a run up front instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hpc_ddp import DistEnv, EvalSums, process_device
from hpc_ddp.env_vars import GRAPH_ALLREDUCE_VAR, GRAPH_FUSED_ADAM_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast.eval_graph import GraphedEval
from hpc_ddp.train.fast.grad_buckets import BucketedAllReduce
from hpc_ddp.train.fast.recording import recording
from hpc_ddp.train.loop import Stepper, Times
from hpc_ddp.train.optim import amp_dtype

if TYPE_CHECKING:
    from hpc_ddp.runtime.evaluation import Batches


def unsupported(cfg: TrainConfig, amp_dtype: torch.dtype | None, devices: int) -> list[str]:
    """The settings the captured step cannot keep exact (see the module docstring), each with
    the reason; empty when it can capture this run."""
    problems = []
    if amp_dtype == torch.float16:
        problems.append("amp=fp16: its loss scaler checks for inf on the host (use bf16 or off)")
    if cfg.accum_steps != 1:
        problems.append(
            f"accum_steps={cfg.accum_steps}: the captured step takes one micro-batch (use 1)"
        )
    if cfg.sync_bn:
        problems.append("sync_bn: SyncBatchNorm is not captured (turn it off)")
    if devices != 1:
        problems.append(f"gpus_per_process={devices}: the captured step drives one GPU (use 1)")
    if cfg.fsdp:
        problems.append("fsdp: FSDP2's gathers of the weights are not captured")
    return problems


def check_supported(cfg: TrainConfig, amp_dtype: torch.dtype | None, devices: int) -> None:
    """Refuse settings the captured step cannot keep exact (``--cuda-graphs`` forced on)."""
    problems = unsupported(cfg, amp_dtype, devices)
    if problems:
        raise ConfigError(
            "--cuda-graphs cannot capture this configuration: " + "; ".join(problems),
            hint="change those settings, or drop --cuda-graphs: by default the run takes the "
            "eager DDP step when it cannot be captured",
        )


@dataclass(frozen=True)
class StepChoice:
    """Whether the step is captured, and why: the trainer logs ``line`` once (rank 0)."""

    captured: bool
    reason: str

    @property
    def line(self) -> str:
        return f"CUDA graphs: {'on' if self.captured else 'off'} ({self.reason})"


def choose(
    cfg: TrainConfig, device: torch.device, amp_dtype: torch.dtype | None, devices: int
) -> StepChoice:
    """The step this run takes. ``auto`` captures whenever the run qualifies, since the captured
    step computes what eager DDP computes (up to rounding: tests/test_gpu.py) with one launch
    per step; ``on`` raises ConfigError where it cannot; ``off`` is eager DDP."""
    if cfg.cuda_graphs == "off":
        return StepChoice(False, "--no-cuda-graphs")
    if device.type != "cuda":
        if cfg.cuda_graphs == "on":
            raise ConfigError(
                f"--cuda-graphs needs a CUDA GPU, and this process runs on {device}",
                hint="drop --cuda-graphs (CPU runs take the eager DDP step), or run on GPUs",
            )
        return StepChoice(False, f"device {device} is not a CUDA GPU")
    if cfg.cuda_graphs == "on":
        check_supported(cfg, amp_dtype, devices)
        return StepChoice(True, "--cuda-graphs")
    problems = unsupported(cfg, amp_dtype, devices)
    if cfg.time_allreduce:  # what it times is eager DDP's all-reduce, through a comm hook
        problems.append("time_allreduce: it times eager DDP's all-reduce")
    if problems:
        return StepChoice(False, "; ".join(problems))
    return StepChoice(True, "auto: this run qualifies; --no-cuda-graphs for eager DDP")


def choose_before_start(cfg: TrainConfig, env: DistEnv) -> StepChoice | None:
    """``choose`` from the launcher's view, before the process group binds the device: what
    start-up prepares for (the torch._dynamo prefetch, the CUDA warm-up). None for settings the
    trainer will refuse: the refusal, with its message, comes after, before any of that work."""
    device = process_device(env)
    try:
        return choose(cfg, device, amp_dtype(cfg, device), len(env.gpus) or 1)
    except ConfigError:
        return None


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """One contiguous gradient buffer; each ``p.grad`` becomes a view into it, with ``p``'s own
    strides (a channels_last weight's gradient is channels_last too: the fused optimizer walks a
    weight and its gradient as flat memory, element for element)."""
    flat = torch.zeros(
        sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
    )
    offset = 0
    for p in params:
        if not _dense(p):
            raise ConfigError(
                f"a parameter of shape {tuple(p.shape)} is a strided view, not a dense tensor",
                hint="use --no-cuda-graphs, or make the model's parameters dense tensors",
            )
        p.grad = flat[offset : offset + p.numel()].as_strided(p.shape, p.stride())
        offset += p.numel()
    return flat


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Adam's capturable mode or SGD's fused kernel, a device-tensor LR, and any loaded state
    moved to the device, laid out as its parameter.

    On CUDA Adam also takes its fused kernel (one launch instead of a dozen multi-tensor ones): the
    same algorithm in less GPU time per captured step (benchmarks/NOTES.md).
    ``env_vars.GRAPH_FUSED_ADAM_VAR`` set to 0 keeps the multi-tensor kernels. SGD has no such
    choice: only its fused kernel reads a tensor LR on the GPU.
    """
    fused = device.type == "cuda" and os.environ.get(GRAPH_FUSED_ADAM_VAR, "1") != "0"
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD):
            group["fused"], group["foreach"] = True, False
        elif "capturable" in group:
            group["capturable"] = True
            if fused and "fused" in group:
                group["fused"], group["foreach"] = True, False
        else:
            raise ConfigError(f"{type(optimizer).__name__} cannot be captured; use Adam or SGD")
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device != device:  # a restore loads it on CPU
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
    for param, state in optimizer.state.items():  # e.g. 'step' restored on the CPU
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.device != device:
                state[key] = value = value.to(device)
            if value.shape == param.shape and value.stride() != param.stride():
                # The fused kernel walks a weight and its state as flat memory: a checkpoint's
                # momentum, written contiguous, must take a channels_last weight's strides.
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


def _dense(t: torch.Tensor) -> bool:
    """``t`` covers its memory exactly once, in some order of its dimensions (contiguous,
    channels_last, ...): a block of ``numel`` elements with its strides is a view of it."""
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return False
        expected *= size
    return True


def broadcast_from_rank0(model: nn.Module) -> None:
    """What DDP's constructor does: every rank starts from rank 0's parameters and buffers."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        for tensor in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(tensor.data, src=0)


class GraphedStep:
    """Call ``step(x, y)`` once per micro-batch instead of the eager DDP step.

    ``model`` is the bare module (not DDP-wrapped). The loss is ``loop.Stepper``'s: cross-entropy
    summed over the batch (returned, for the log) and divided by the batch size for backward.
    ``step`` returns it as a device tensor that the next call overwrites: read it (or add it to
    an accumulator) before calling again.

    ``allreduce_in_graph=False`` captures two graphs (forward+backward, optimizer) around an
    eager all-reduce: one more launch per step, for NCCL builds that cannot be captured.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        amp_dtype: torch.dtype | None = None,
        warmup: int = 3,
        capture: bool = True,
        allreduce_in_graph: bool = True,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.amp_dtype = amp_dtype
        self.warmup = warmup
        self.capture = capture
        self.allreduce_in_graph = allreduce_in_graph
        self.device = next(model.parameters()).device
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        # Reversed: backward produces the last layers' gradients first, so the buckets that
        # fill first lie at the front of the buffer (grad_buckets).
        params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.flat = flat_grads(params)
        self.buckets: BucketedAllReduce | None = None
        if self.world_size > 1 and allreduce_in_graph:
            self.buckets = BucketedAllReduce(params, self.flat, self.world_size)
        broadcast_from_rank0(model)
        self.prepared = False  # make_capturable runs at the first step, after any restore
        self.loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.static_x: torch.Tensor | None = None
        self.static_y: torch.Tensor | None = None
        self.eager_steps = 0
        self.replays = 0
        # Called before capture: CUDA refuses other threads' allocations of pinned memory while
        # a stream captures, so a background checkpoint save still copying to the host must
        # finish first (a resumed run reaches capture after its first epoch-end save).
        self.before_capture: Callable[[], object] | None = None

    def _autocast(self) -> AbstractContextManager:
        if self.amp_dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype, cache_enabled=False)

    # The step in three parts; identical whether run eagerly or recorded into a graph.
    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.flat.zero_()  # backward accumulates into the .grad views, so start from zero
        if self.buckets is not None:
            self.buckets.begin()
        with self._autocast():
            out = self.model(x)
        loss = F.cross_entropy(out.float(), y, reduction="sum")
        (loss / y.shape[0]).backward()
        self.loss.copy_(loss.detach())

    def _allreduce(self) -> None:
        if self.buckets is not None:  # started during backward: the rest, then the average
            self.buckets.finish()
        elif self.world_size > 1:  # DDP's average: sum of the ranks' gradients / world size
            dist.all_reduce(self.flat, op=dist.ReduceOp.SUM)
            self.flat.div_(self.world_size)

    def _update(self) -> None:
        self.optimizer.step()

    def _eager(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        def body() -> None:
            self._forward_backward(x, y)
            self._allreduce()
            self._update()

        if self.device.type == "cuda" and self.capture:
            # Warm-up on a side stream, as torch.cuda.graph's documentation asks.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                body()
            torch.cuda.current_stream(self.device).wait_stream(side)
        else:
            body()
        self.eager_steps += 1
        return self.loss

    def _capture(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.static_x = torch.empty_like(x)
        self.static_y = torch.empty_like(y)
        if self.before_capture is not None:
            self.before_capture()
        torch.cuda.synchronize(self.device)
        first = torch.cuda.CUDAGraph()
        with recording(first):
            self._forward_backward(self.static_x, self.static_y)
            if self.allreduce_in_graph:
                self._allreduce()
                self._update()
        self.graphs = [first]
        if not self.allreduce_in_graph:
            second = torch.cuda.CUDAGraph()
            with recording(second, pool=first.pool()):
                self._update()
            self.graphs.append(second)

    def release(self) -> None:
        """Destroy the graphs. Must run before the process group is destroyed: NCCL keeps the
        resources of a captured all-reduce until its graph is gone, and ncclCommDestroy waits
        for them, so destroying the group first hangs forever (benchmarks/NOTES.md)."""
        if self.buckets is not None:
            self.buckets.remove()
        if self.graphs:
            torch.cuda.synchronize(self.device)
            for graph in self.graphs:
                graph.reset()
            self.graphs = []
            torch.cuda.synchronize(self.device)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.prepared:  # after the trainer restored a checkpoint into the optimizer
            if self.capture and self.device.type == "cuda":
                make_capturable(self.optimizer, self.device)
            self.prepared = True
        if not self.capture or self.device.type != "cuda" or self.eager_steps < self.warmup:
            return self._eager(x, y)
        if not self.graphs:
            self._capture(x, y)
        assert self.static_x is not None and self.static_y is not None
        if x.shape != self.static_x.shape or y.shape != self.static_y.shape:
            return self._eager(x, y)  # a differently sized batch: exact, just not captured
        self.static_x.copy_(x)
        self.static_y.copy_(y)
        self.graphs[0].replay()
        if len(self.graphs) > 1:
            self._allreduce()
            self.graphs[1].replay()
        self.replays += 1
        return self.loss


@dataclass
class GraphedStepper(Stepper):
    """A ``loop.Stepper`` whose ``step`` replays a ``GraphedStep``, so the trainer switches with
    one line. ``model`` is the bare module; ``comm_timer`` only counts the all-reduces."""

    graphed: GraphedStep = field(init=False)
    evaluation: GraphedEval = field(init=False)

    def __post_init__(self) -> None:
        # GRAPH_ALLREDUCE_VAR=0: keep the all-reduce out of the graph (see GraphedStep).
        in_graph = os.environ.get(GRAPH_ALLREDUCE_VAR, "1") != "0"
        self.graphed = GraphedStep(
            self.model, self.optimizer, amp_dtype=self.amp_dtype, allreduce_in_graph=in_graph
        )
        self.evaluation = GraphedEval(self.model, self.graphed.device, pool=self._step_pool)

    def _step_pool(self) -> object | None:
        """The training graph's memory pool, once captured (eval_graph: why it is shared)."""
        return self.graphed.graphs[0].pool() if self.graphed.graphs else None

    def eval_sums(
        self, model: nn.Module, batches: Batches, amp_dtype: torch.dtype | None
    ) -> EvalSums:
        """Evaluation replayed as CUDA graphs (``eval_graph``): one launch per batch."""
        return self.evaluation.accumulate(model, batches, amp_dtype)

    def step(
        self, micro: list[tuple[torch.Tensor, torch.Tensor]], times: Times
    ) -> tuple[torch.Tensor, int]:
        """Like ``loop.Stepper.step``: the loss sum stays on the device (float64, a copy: the
        graph overwrites its own at the next replay)."""
        if len(micro) != 1:
            raise ConfigError("--cuda-graphs takes one micro-batch per step (accum_steps=1)")
        t0 = time.perf_counter()
        x, y = micro[0]
        loss = self.graphed.step(x, y.to(self.out_device))
        self.scheduler.step()
        result = loss.double()  # a new tensor, queued after the step: no host sync
        times.compute += time.perf_counter() - t0
        self.comm_timer.bucket_calls += int(self.graphed.world_size > 1)
        return result, len(y)

    def close(self) -> None:
        """Call before ``destroy_process_group`` (see ``GraphedStep.release``)."""
        self.evaluation.release()
        self.graphed.release()
