"""Eager gradient averaging over Gloo without DDP: each gradient all-reduced on its own.

Why: over Gloo each gradient is averaged with its own all-reduce, for bit-exact resume at any
world size (runtime/exact_allreduce.py), which under DDP takes a comm hook. DDP then adds
nothing else a CPU job needs, and costs its torch._dynamo import (its constructor reads
torch._dynamo's settings, its forward enters a ``torch._disable_dynamo`` wrapper): seconds of
CPU time per process on a small machine (benchmarks/NOTES.md). This does the hook's arithmetic
itself, after backward: each gradient divided by the world size, then summed over the ranks by
its own all-reduce. The result equals DDP with that hook bit for bit (tests/test_train_ddp.py
compares them); each all-reduce's summation order depends on its tensor alone, as under the hook.

What DDP also did, done here too: rank 0's parameters and buffers broadcast at the start, and
rank 0's buffers broadcast before each step's forward when the model has buffers other than
normalization statistics (``sync.training_reads_buffers``). A parameter that got no gradient
fails the step (exit 2, naming it), as under DDP without ``find_unused_parameters``:
averaging it on some ranks and not others would pair different tensors in the collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hpc_ddp import average_each
from hpc_ddp.errors import ConfigError, first_few
from hpc_ddp.train.loop import CommTimer


class PerTensorAverage:
    """``average`` after backward: every trainable gradient of ``net`` averaged over ranks."""

    def __init__(self, net: nn.Module, *, sync_buffers: bool) -> None:
        self.params = [(name, p) for name, p in net.named_parameters() if p.requires_grad]
        self.buffers = list(net.buffers())
        self.sync_buffers = sync_buffers
        with torch.no_grad():  # every rank starts from rank 0's weights and statistics
            for tensor in [*net.parameters(), *self.buffers]:
                dist.broadcast(tensor.detach(), src=0)

    def before_forward(self) -> None:
        """Before a step's first forward: rank 0's buffers, where training may read them."""
        if self.sync_buffers:
            for buf in self.buffers:
                dist.broadcast(buf, src=0)

    def average(self, timer: CommTimer) -> None:
        """Average each gradient over the ranks, timed into ``timer`` as the hook was."""
        missing = [name for name, p in self.params if p.grad is None]
        if missing:
            raise ConfigError(
                f"the model's parameters {first_few(missing, 8)} got no gradient in this step: "
                "every rank must average the same gradients",
                hint="leave parameters that take no part in the loss out of the model, or set "
                "requires_grad=False on them",
            )
        timer.launched()
        for work in average_each([p.grad for _, p in self.params if p.grad is not None]):
            work.wait()
        timer.done()
