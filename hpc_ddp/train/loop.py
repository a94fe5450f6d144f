"""One optimizer step (accumulation, no_sync, AMP), exact evaluation, and time accounting."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from hpc_ddp import EvalSums, eval_sums, per_tensor_comm_hook

if TYPE_CHECKING:
    from hpc_ddp.runtime.evaluation import Batches
    from hpc_ddp.train.fast.tensor_average import PerTensorAverage


@dataclass
class Times:
    """Seconds per phase of an epoch (this rank's view; rank 0's is logged)."""

    data: float = 0.0  # waiting for the next batch
    compute: float = 0.0  # forward + backward + optimizer (includes waiting on the all-reduce)
    comm: float = 0.0  # gradient all-reduce, first bucket launch to last completion
    checkpoint: float = 0.0
    eval: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {k: round(v, 6) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Times:
        return cls(**{k: float(v) for k, v in d.items()})


@dataclass
class CommTimer:
    """State of the timing comm hook: it wraps DDP's default all-reduce (same numerics)."""

    first_launch: float | None = None
    last_done: float = 0.0
    bucket_calls: int = 0  # all-reduce launches; no_sync micro-steps add none
    # Reduce each gradient on its own, not DDP's flat bucket (runtime/exact_allreduce.py: why).
    per_tensor: bool = False

    def launched(self) -> None:
        """An all-reduce (a bucket's, or a step's gradients) starts now."""
        self.bucket_calls += 1
        if self.first_launch is None:
            self.first_launch = time.perf_counter()

    def done(self) -> None:
        """The latest all-reduce ended now."""
        self.last_done = time.perf_counter()

    def take(self) -> float:
        """All-reduce seconds since the last call (overlaps backward on purpose: that is DDP)."""
        spent = 0.0 if self.first_launch is None else max(self.last_done - self.first_launch, 0.0)
        self.first_launch = None
        return spent


def timed_allreduce(timer, bucket):  # DDP rejects annotations other than its own types
    """DDP comm hook: DDP's default all-reduce (same numerics), timed into ``timer``."""
    timer.launched()
    if timer.per_tensor:
        fut = per_tensor_comm_hook(None, bucket)
    else:
        fut = default_hooks.allreduce_hook(None, bucket)  # None: the default process group

    def done(f):
        timer.done()
        return f.value()

    return fut.then(done)


def grouped(batches: Iterable[Any], size: int, times: Times) -> Iterator[list[Any]]:
    """Micro-batches in groups of ``size`` (the last group may be short), timing the waits."""
    group: list[Any] = []
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        try:
            item = next(it)
        except StopIteration:
            times.data += time.perf_counter() - t0
            break
        times.data += time.perf_counter() - t0
        group.append(item)
        if len(group) == size:
            yield group
            group = []
    if group:
        yield group


@dataclass
class Stepper:
    """Runs optimizer steps on a model that is DDP-wrapped, averaged by ``averager`` after
    backward, or alone (one process)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    amp_dtype: torch.dtype | None
    out_device: torch.device
    comm_timer: CommTimer = field(default_factory=CommTimer)
    averager: PerTensorAverage | None = None  # Gloo: gradients averaged after backward

    def close(self) -> None:
        """Nothing to release before ``destroy_process_group`` (the graphed stepper has)."""

    def accumulating(self) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch that is not its step's last: DDP's ``no_sync`` (the gradients
        are averaged once, with the last one's), or nothing where they are averaged after
        backward."""
        return self.model.no_sync() if isinstance(self.model, DDP) else contextlib.nullcontext()

    def eval_sums(
        self, model: nn.Module, batches: Batches, amp_dtype: torch.dtype | None
    ) -> EvalSums:
        """Evaluation's per-rank sums (``evaluate``'s ``sums_of``): eager, batch by batch."""
        return eval_sums(model, batches, amp_dtype)

    def step(
        self, micro: list[tuple[torch.Tensor, torch.Tensor]], times: Times
    ) -> tuple[torch.Tensor, int]:
        """One optimizer step over ``micro``; returns (sum of per-sample losses, samples).

        The loss sum is a float64 scalar on the output device, not read here: reading it would
        make the host wait for the GPU every step (the trainer reads it at its sync points,
        trainer.py), so ``times.compute`` counts the host's part; the wait lands at the sync.

        Each micro-batch's loss is divided by the step's sample count, so the accumulated
        gradient is the mean over the whole step, as one big batch would give; all ranks have
        equal counts (the sampler pads), so DDP's average over ranks keeps it a global mean.
        Non-final micro-batches run under ``no_sync``: one all-reduce per step, not per micro.
        """
        t0 = time.perf_counter()
        total = sum(len(y) for _, y in micro)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.out_device)
        if self.averager is not None:
            self.averager.before_forward()
        for i, (x, y) in enumerate(micro):
            ctx = contextlib.nullcontext() if i == len(micro) - 1 else self.accumulating()
            with ctx:
                with torch.autocast(
                    x.device.type,
                    dtype=self.amp_dtype or torch.float32,
                    enabled=bool(self.amp_dtype),
                ):
                    out = self.model(x)
                loss = F.cross_entropy(out.float(), y.to(out.device), reduction="sum")
                self.scaler.scale(loss / total).backward()
            loss_sum += loss.detach().double()
        if self.averager is not None:  # after the last micro-batch: no_sync's equivalent
            self.averager.average(self.comm_timer)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        times.compute += time.perf_counter() - t0
        times.comm += self.comm_timer.take()
        return loss_sum, total
