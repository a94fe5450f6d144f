"""Exact distributed evaluation: every test sample counted once, on every layout."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hpc_ddp.runtime.collectives import Comm
from hpc_ddp.runtime.sampler import eval_indices

__all__ = ["eval_indices", "evaluate"]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    comm: Comm | None = None,
    amp_dtype: torch.dtype | None = None,
) -> dict[str, float]:
    """Exact test metrics over every rank's shard: each sample counted once, none padded in.

    ``batches`` are this rank's ``(inputs, labels)`` of its evaluation shard (``eval_indices``:
    the shards partition the test set, unlike DistributedSampler, which pads). Each rank sums
    (loss, correct, count); one all-reduce SUM over the process group (``comm``, default: the
    initialised group on the model's device) gives every rank the same ``test_loss``,
    ``test_accuracy`` and ``test_samples``.
    """
    if comm is None:
        comm = Comm(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    # Sums stay on the device until the end: a host read per batch would make the CPU wait
    # for the GPU every batch. float64 from float32 batch sums, in batch order: the same
    # numbers as summing Python floats.
    loss_sum: torch.Tensor | None = None
    correct_sum: torch.Tensor | None = None
    count = 0
    for x, y in batches:
        with torch.autocast(
            x.device.type, dtype=amp_dtype or torch.float32, enabled=bool(amp_dtype)
        ):
            out = model(x)
        y = y.to(out.device)
        batch_loss = F.cross_entropy(out.float(), y, reduction="sum").double()
        batch_correct = (out.argmax(1) == y).sum()
        loss_sum = batch_loss if loss_sum is None else loss_sum + batch_loss
        correct_sum = batch_correct if correct_sum is None else correct_sum + batch_correct
        count += len(y)
    model.train(was_training)
    loss = float(loss_sum) if loss_sum is not None else 0.0
    correct = float(correct_sum) if correct_sum is not None else 0.0
    per_rank = comm.gather_objects(count)
    loss, correct, count = comm.sum([loss, correct, float(count)])
    return {
        "test_loss": loss / max(count, 1),
        "test_accuracy": correct / max(count, 1),
        "test_samples": int(count),
        "test_samples_per_rank": per_rank,
    }
