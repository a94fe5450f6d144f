"""Gradient all-reduce whose summation order DDP's bucket layout cannot change.

With more than two ranks, a ring all-reduce (Gloo's; NCCL's too) sums each element in an order set
by where it falls in the flat bucket. DDP lays its buckets out afresh after its first step, in the
order gradients arrived, so a run resumed from a checkpoint reduces its first step under the
initial layout where the uninterrupted run used the rebuilt one, and the weights drift apart in
the last bits. Reducing each gradient on its own makes the order depend on the tensor alone:
resume stays bit-exact at any world size, for a few more (small) collectives per step.
(With two ranks every order gives a + b, which is why small tests do not see the drift.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def average_each(tensors: list[torch.Tensor]) -> list[dist.Work]:
    """Start averaging each tensor in place over the ranks: divided by the world size, then
    summed by an all-reduce of its own. Returns the works to wait for."""
    world = dist.get_world_size()
    works = []
    for t in tensors:
        t.div_(world)
        works.append(dist.all_reduce(t, async_op=True))
    return works


def allreduce_per_tensor(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average each gradient of ``bucket`` with its own all-reduce, then refill DDP's buffer."""
    grads = [g.clone() for g in bucket.gradients()]
    works = [work.get_future() for work in average_each(grads)]
    buffer = bucket.buffer()

    def refill(_: torch.futures.Future[list[torch.futures.Future[torch.Tensor]]]) -> torch.Tensor:
        buffer.copy_(torch.cat([g.reshape(-1) for g in grads]))
        return buffer

    return torch.futures.collect_all(works).then(refill)


def per_tensor_comm_hook(state, bucket):  # DDP rejects annotations other than its own types
    """DDP comm hook (``model.register_comm_hook(None, per_tensor_comm_hook)``, ``state``
    unused): each gradient of the bucket averaged with its own all-reduce."""
    return allreduce_per_tensor(bucket)


def per_tensor_allreduce(model: DistributedDataParallel) -> DistributedDataParallel:
    """Make ``model`` (a DDP module) average each gradient with its own all-reduce, so that a
    resumed run sums gradients in the same order as the uninterrupted one (bit-exact resume with
    more than two ranks). Call it once, before the first step; returns ``model``. It costs one
    collective per parameter: meant for Gloo (CPU) and small models; on NCCL, DDP's buckets are
    much faster and the kernels are not bit-exact anyway."""
    model.register_comm_hook(None, per_tensor_comm_hook)
    return model
