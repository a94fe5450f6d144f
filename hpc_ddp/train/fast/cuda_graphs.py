"""``--cuda-graphs``: the trainer's step as the public ``hpc_ddp.CapturedStep`` (forward, backward,
gradient all-reduce and optimizer as one CUDA graph replayed per micro-batch: its module,
hpc_ddp/runtime/captured_step.py, says why and how it stays exact), with the trainer's loss, its
evaluation graphs sharing the step's memory pool (eval_graph.py) and the choice of when to take it.

Limits here: Adam/AdamW or SGD (SGD through its fused kernel: the multi-tensor one reads a tensor LR
on the host), no fp16 loss scaling (its inf check syncs with the host), no gradient
accumulation, no SyncBN, one CUDA GPU per process. ``choose`` applies them: by default
(``cuda_graphs="auto"``) a run that meets them is captured and any other runs eager DDP, saying
why in one log line; ``--cuda-graphs`` (``on``) refuses such a run up front instead.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hpc_ddp import CapturedStep, DistEnv, EvalSums, process_device
from hpc_ddp.env_vars import GRAPH_ALLREDUCE_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast.eval_graph import GraphedEval
from hpc_ddp.train.loop import Stepper, Times
from hpc_ddp.train.optim import amp_dtype

if TYPE_CHECKING:
    from hpc_ddp.runtime.evaluation import Batches

log = get_logger("train")


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


class _SummedLoss:
    """``loop.Stepper``'s loss: cross-entropy summed over the batch, kept in ``total`` for the
    log (a device tensor the graph writes at each replay), divided by the batch size for
    backward."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        total = F.cross_entropy(out.float(), y, reduction="sum")
        if self.total is None:  # made in the eager warm-up, never inside a capture
            self.total = torch.zeros((), dtype=torch.float32, device=total.device)
        self.total.copy_(total.detach())
        return total / y.shape[0]


class GraphedStep(CapturedStep):
    """``hpc_ddp.CapturedStep`` with the trainer's loss: ``step(x, y)`` returns the summed
    cross-entropy (``_SummedLoss``), a device tensor that the next call overwrites. The
    trainer's ``CUDA graphs:`` line says what the step's own line would (debug level here)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, **kw: Any) -> None:
        self.summed = _SummedLoss()
        super().__init__(model, optimizer, loss_fn=self.summed, log=log.debug, **kw)

    def step(self, x: torch.Tensor, y: torch.Tensor, *, sync: bool | None = None) -> torch.Tensor:
        super().step(x, y, sync=sync)
        assert self.summed.total is not None  # the first micro-batch made it
        return self.summed.total

    def release(self) -> None:
        """``close``: before the process group is destroyed."""
        self.close()


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
        return self.graphed.pool

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
