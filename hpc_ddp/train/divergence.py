"""A run whose numbers went bad: the loss, or the state a checkpoint would hold, NaN or infinite.

The trainer looks only where the values reach the host anyway, so a step costs nothing more:

- every step's loss, at the sync point that folds it into the epoch's sums (trainer.py): the
  all-reduced sums, so a NaN on one rank is a NaN on every rank, and all ranks find the same
  first bad step at the same sync point;
- the test loss of each evaluation (all-reduced too), before the epoch's row is written;
- before every checkpoint, the state it would hold: weights, buffers and optimizer state. A
  step whose loss was finite can still leave non-finite weights (an overflowing update), which
  only the next step's loss would show. A few multi-tensor reductions and one host read per
  device and save, and one all-reduce, so that every rank takes the same decision.

What follows (trainer.Trainer.diverged): every rank raises :class:`TrainingDiverged` at that
point; nothing is saved after it, so no finite checkpoint is rotated out and the newest one is
the last finite state; progress.json says ``diverged``; the processes exit with
``EXIT_DIVERGED``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from hpc_ddp.dtensors import dtensor_type
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.exit_codes import EXIT_DIVERGED
from hpc_ddp.train.config import TrainConfig


class TrainingDiverged(HpcDdpError):
    """The loss or the training state became NaN or infinite at ``step`` (global)."""

    exit_code = EXIT_DIVERGED

    def __init__(
        self,
        what: str,
        *,
        step: int,
        epoch: int,
        stopped: int,
        checkpoint: str | None,
        cfg: TrainConfig,
    ) -> None:
        self.what, self.step, self.epoch, self.checkpoint = what, step, epoch, checkpoint
        where = "there" if stopped == step else f"at step {stopped}, where the loss was next read"
        if checkpoint is None:
            kept = "No checkpoint was written before it."
            again = "re-running this command starts it over"
        else:
            kept = (
                f"The newest checkpoint, {checkpoint}, holds the last finite state and is "
                "kept; nothing was saved after it."
            )
            again = f"re-running this command resumes from {checkpoint}"
        super().__init__(
            f"training diverged: {what} at step {step} (epoch {epoch}); every rank stopped "
            f"{where}. {kept}",
            hint=f"try a lower --lr (this run: {cfg.lr:g}){_more_advice(cfg)}, in a new "
            f"--run-dir (those settings are part of this run's identity); {again} with the "
            "same settings and will most likely diverge again",
        )


def _more_advice(cfg: TrainConfig) -> str:
    advice = []
    if cfg.warmup_steps == 0:
        advice.append("a warm-up (--warmup-steps, e.g. 500)")
    if cfg.amp == "fp16":
        advice.append("--amp bf16 (fp16 overflows above 65504)")
    return "".join(f", {item}" for item in advice)


def first_nonfinite(values: Iterable[float]) -> int | None:
    """Index of the first value that is NaN or infinite; None when all are finite."""
    return next((i for i, value in enumerate(values) if not math.isfinite(value)), None)


def state_is_finite(net: torch.nn.Module, optimizer: torch.optim.Optimizer) -> bool:
    """Whether every floating-point tensor of ``net`` (weights and buffers) and of
    ``optimizer``'s state is finite.

    By the tensors' norms, as ``clip_grad_norm_(error_if_nonfinite=True)`` finds non-finite
    gradients: one multi-tensor kernel per device and dtype, one host read per device. A sum of
    squares is NaN or infinite when any element is, whatever a device's maximum does with NaN;
    it also overflows for elements past about 1.8e19 (fp32, bf16): such a state is as diverged.
    fp16 tensors' norms are taken in fp32, where an fp16 norm would overflow at 65504.
    """
    tensors = [*net.parameters(), *net.buffers()]
    for per_param in optimizer.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor)]
    # A sharded model (FSDP2) holds DTensors: each rank checks its own shards, and the trainer
    # adds up the ranks' answers.
    dtensor = dtensor_type()
    if dtensor is not None:
        tensors = [t.to_local() if isinstance(t, dtensor) else t for t in tensors]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append(t.detach())
    flags = []
    for group in by_device.values():
        wide = [t for t in group if t.dtype != torch.float16]
        norms = list(torch._foreach_norm(wide)) if wide else []
        norms += [
            torch.linalg.vector_norm(t, dtype=torch.float32)
            for t in group
            if t.dtype == torch.float16
        ]
        flags.append(torch.stack([n.float() for n in norms]).isfinite().all())
    return all(bool(flag) for flag in flags)
