"""How the eager step averages gradients over the ranks, and DDP's settings when it is DDP's."""

from __future__ import annotations

import inspect
from typing import Literal

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

GradientSync = Literal["ddp", "per_tensor", "none"]


def gradient_sync(backend: str, world_size: int, captured: bool) -> GradientSync:
    """How the eager step averages gradients over the ranks.

    - "none": the captured step all-reduces itself; a job of one process has nothing to
      average (DDP would all-reduce each gradient with itself, an identity bit for bit, and cost
      its wrapper's host time per step and its torch._dynamo import: prefetch.needs_dynamo).
    - "per_tensor" over Gloo: each gradient by its own all-reduce after backward, DDP's
      per-tensor comm hook's arithmetic without DDP and its torch._dynamo import
      (tensor_average.py).
    - "ddp" otherwise (NCCL, MPI): DDP's buckets, overlapped with backward.
    """
    if world_size == 1 or captured:
        return "none"
    return "per_tensor" if backend == "gloo" else "ddp"


def ddp_options(net: torch.nn.Module, *, one_device: bool = True) -> dict[str, bool]:
    """DDP's settings for this trainer: less host work per step, the same results.

    - ``gradient_as_bucket_view``: gradients live in DDP's all-reduce buckets, instead of being
      copied in and out of them by one kernel per parameter and direction every step.
    - ``forward_sync_buffers=False`` when every buffer is a normalization layer's running
      statistics: in training those layers use the batch's statistics, so rank 0's buffers and
      every gradient are what they would be with DDP's broadcast before each forward (one
      NCCL broadcast plus a copy per buffer). Rank 0's buffers reach the other ranks where they
      are read: before each evaluation (``Comm.broadcast_buffers``); checkpoints hold rank 0's.
      Any other buffer may be read in training, so such a model keeps DDP's broadcast.
      (torch 2.13 renamed ``broadcast_buffers`` to this; the old name warns on every rank,
      and older releases know only the old one, which they get. Unlike
      ``broadcast_buffers=False`` it still broadcasts buffers once at construction: the model
      is built from the same seed on every rank, so that copies equal values.)

    tests/test_train_ddp.py checks both against DDP's defaults, bit for bit. A model split
    across a process's GPUs keeps DDP's defaults: only the one-device case is known to gain
    and was tested on GPUs (benchmarks/NOTES.md).
    """
    if not one_device:
        return {}
    return {"gradient_as_bucket_view": True, _SYNC_BUFFERS: training_reads_buffers(net)}


def training_reads_buffers(net: torch.nn.Module) -> bool:
    """Whether ``net`` has a buffer other than a normalization layer's running statistics (which
    training does not read): then rank 0's buffers are broadcast before each step's forward."""
    norm = torch.nn.modules.batchnorm._NormBase
    owners = [m for m in net.modules() if next(m.buffers(recurse=False), None) is not None]
    return not all(isinstance(m, norm) for m in owners)


# DDP's keyword for the broadcast of buffers before each forward, by torch release.
_SYNC_BUFFERS = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
    else "broadcast_buffers"
)
