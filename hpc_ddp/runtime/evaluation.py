"""Exact distributed evaluation: every test sample counted once, on every layout."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hpc_ddp.runtime.collectives import Comm
from hpc_ddp.runtime.shard_plan import eval_indices

__all__ = ["EvalSums", "accumulate", "batch_terms", "eval_indices", "evaluate", "totals"]

Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class EvalSums:
    """One rank's running sums, kept on the device so no batch makes the host wait for the GPU:
    the summed loss (float64, from each batch's float32 sum, in batch order: the same numbers as
    summing Python floats), the correct predictions (int64) and the samples (a host count)."""

    loss: torch.Tensor
    correct: torch.Tensor
    count: int = 0

    @classmethod
    def zeros(cls, device: torch.device) -> EvalSums:
        return cls(
            torch.zeros((), dtype=torch.float64, device=device),
            torch.zeros((), dtype=torch.int64, device=device),
        )

    def add_batch(
        self,
        model: nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        amp_dtype: torch.dtype | None,
        *,
        cast_cache: bool = True,
    ) -> None:
        """Add one batch in place: device work only, so a CUDA graph can record it (the caller
        counts the samples; a recording turns autocast's ``cast_cache`` off, as graphs need)."""
        loss, correct = batch_terms(model, x, y, amp_dtype, cast_cache=cast_cache)
        self.loss += loss
        self.correct += correct


def batch_terms(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    amp_dtype: torch.dtype | None,
    *,
    cast_cache: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch's summed loss (float64 of the float32 sum) and correct predictions (int64)."""
    with torch.autocast(
        x.device.type,
        dtype=amp_dtype or torch.float32,
        enabled=bool(amp_dtype),
        cache_enabled=cast_cache,
    ):
        out = model(x)
    y = y.to(out.device)
    return F.cross_entropy(out.float(), y, reduction="sum").double(), (out.argmax(1) == y).sum()


def accumulate(model: nn.Module, batches: Batches, amp_dtype: torch.dtype | None) -> EvalSums:
    """This rank's sums over ``batches``, eagerly (the caller sets eval mode and no_grad)."""
    sums: EvalSums | None = None
    count = 0
    for x, y in batches:
        if sums is None:  # on the output's device (a model split across GPUs: its last one)
            sums = EvalSums(*batch_terms(model, x, y, amp_dtype))
        else:
            sums.add_batch(model, x, y, amp_dtype)
        count += len(y)
    if sums is None:
        return EvalSums.zeros(torch.device("cpu"))
    sums.count = count
    return sums


def totals(sums: EvalSums, rank: int, world_size: int) -> torch.Tensor:
    """``[loss, correct, samples of rank 0, ..., samples of rank n-1]`` on the sums' device: the
    per-rank counts ride in the same all-reduce (each rank fills only its own slot), and one
    host read ends it."""
    out = torch.zeros(2 + world_size, dtype=torch.float64, device=sums.loss.device)
    out[0] = sums.loss
    out[1] = sums.correct
    out[2 + rank] = sums.count
    return out


Accumulate = Callable[[nn.Module, Batches, "torch.dtype | None"], EvalSums]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Batches,
    comm: Comm | None = None,
    amp_dtype: torch.dtype | None = None,
    *,
    sums_of: Accumulate = accumulate,
) -> dict[str, float]:
    """Exact test metrics over every rank's shard: each sample counted once, none padded in.

    ``batches`` are this rank's ``(inputs, labels)`` of its evaluation shard (``eval_indices``:
    the shards partition the test set, unlike DistributedSampler, which pads). Each rank sums
    loss, correct predictions and samples (``sums_of``: eagerly by default; the trainer passes a
    captured one when its step is a CUDA graph); one all-reduce SUM over the process group
    (``comm``, default: the initialised group on the model's device) gives every rank the same
    ``test_loss``, ``test_accuracy``, ``test_samples`` and ``test_samples_per_rank``.
    """
    if comm is None:
        comm = Comm(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    try:
        sums = sums_of(model, batches, amp_dtype)
    finally:
        model.train(was_training)
    loss, correct, *per_rank = comm.sum_tensor(totals(sums, comm.rank, comm.world_size))
    count = sum(per_rank)
    return {
        "test_loss": loss / max(count, 1),
        "test_accuracy": correct / max(count, 1),
        "test_samples": int(count),
        "test_samples_per_rank": [int(c) for c in per_rank],
    }
