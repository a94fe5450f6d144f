"""The captured step's gradients: one flat buffer that every ``.grad`` views (``flat_grads``), and
its all-reduce, started bucket by bucket while backward runs, as DDP's is (``BucketedAllReduce``).

Why: one all-reduce of the whole flat gradient after backward leaves all of it exposed.
Overlapped with backward, less of it shows in the step (NCCL's kernels still slow the backward
beside them), which raises weak scaling; smaller buckets than DDP's expose more, not less
(benchmarks/NOTES.md).

How: the flat gradient buffer is laid out in reverse parameter order (the order in which
backward roughly produces gradients) and cut into contiguous buckets of DDP's default sizes. A
hook on each parameter counts its bucket down once its gradient is accumulated; a finished bucket
starts an asynchronous all-reduce (on NCCL's own stream, after the work queued so far), and
backward goes on. Buckets start strictly in index order, so every rank issues the same
collectives in the same order whatever order its hooks fire in; a bucket that backward left
unfinished (a parameter that got no gradient) starts in ``finish``, which then waits for all of
them and divides by the world size: DDP's average, element by element what the single
all-reduce computed (NCCL may sum a bucket's elements in another order: rounding only).

Inside a CUDA graph capture the same calls are recorded: the hooks run on autograd's thread with
the capturing stream current, which is how DDP's own reducer is captured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from hpc_ddp.errors import ConfigError

FIRST_BUCKET_BYTES = 1 << 20  # DDP's: a small first bucket starts the communication early
BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb default


def flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
    """One contiguous gradient buffer; each ``p.grad`` becomes a view into it, with ``p``'s own
    strides (a channels_last weight's gradient is channels_last too: the fused optimizer walks a
    weight and its gradient as flat memory, element for element). ``params`` share one device
    and dtype (``CapturedStep`` checks)."""
    flat = torch.zeros(
        sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
    )
    offset = 0
    for p in params:
        if not dense(p):
            raise ConfigError(
                f"a parameter of shape {tuple(p.shape)} is a strided view, not a dense tensor",
                hint="make the model's parameters dense tensors (e.g. .contiguous() copies), "
                "or step it through DDP instead of a captured step",
            )
        p.grad = flat[offset : offset + p.numel()].as_strided(p.shape, p.stride())
        offset += p.numel()
    return flat


def dense(t: torch.Tensor) -> bool:
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


def bucket_bounds(
    numels: Sequence[int],
    element_size: int,
    first_bytes: int = FIRST_BUCKET_BYTES,
    bytes_per_bucket: int = BUCKET_BYTES,
) -> list[tuple[int, int]]:
    """Cut tensors of ``numels`` elements (in buffer order) into buckets of whole tensors: each
    bucket is (first tensor, one past its last) and closes once it holds ``first_bytes`` (the
    first bucket) or ``bytes_per_bucket`` (the others) or more."""
    bounds: list[tuple[int, int]] = []
    start, size = 0, 0
    for i, numel in enumerate(numels):
        size += numel * element_size
        if size >= (bytes_per_bucket if bounds else first_bytes):
            bounds.append((start, i + 1))
            start, size = i + 1, 0
    if start < len(numels):
        bounds.append((start, len(numels)))
    return bounds


@dataclass
class BucketedAllReduce:
    """Sum ``flat`` (the gradients of ``params``, laid out in this order) over the ranks,
    bucket by bucket during backward. Call ``begin`` before each backward and ``finish`` after
    it; ``remove`` takes the hooks off the parameters."""

    params: list[nn.Parameter]
    flat: torch.Tensor
    world_size: int
    first_bytes: int = FIRST_BUCKET_BYTES
    bytes_per_bucket: int = BUCKET_BYTES
    bounds: list[tuple[int, int]] = field(init=False)
    _slices: list[torch.Tensor] = field(init=False)
    _left: list[int] = field(init=False, default_factory=list)
    _next: int = field(init=False, default=0)
    _works: list[dist.Work] = field(init=False, default_factory=list)
    _active: bool = field(init=False, default=False)
    _hooks: list[RemovableHandle] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        numels = [p.numel() for p in self.params]
        self.bounds = bucket_bounds(
            numels, self.flat.element_size(), self.first_bytes, self.bytes_per_bucket
        )
        offsets = [0]
        for numel in numels:
            offsets.append(offsets[-1] + numel)
        self._slices = [self.flat[offsets[a] : offsets[b]] for a, b in self.bounds]
        for index, (a, b) in enumerate(self.bounds):
            for p in self.params[a:b]:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(index)))

    @property
    def started(self) -> int:
        """How many buckets have started their all-reduce since ``begin``."""
        return self._next

    def _hook(self, bucket: int) -> Callable[[torch.Tensor], None]:
        def ready(_param: torch.Tensor) -> None:
            if self._active:
                self._left[bucket] -= 1
                self._start_ready()

        return ready

    def begin(self) -> None:
        self._left = [b - a for a, b in self.bounds]
        self._next = 0
        self._works = []
        self._active = True

    def _start(self) -> None:
        work = dist.all_reduce(self._slices[self._next], op=dist.ReduceOp.SUM, async_op=True)
        self._works.append(work)
        self._next += 1

    def _start_ready(self) -> None:
        while self._next < len(self.bounds) and self._left[self._next] == 0:
            self._start()

    def finish(self) -> None:
        """Start what backward did not, wait for every bucket (the current stream waits, the
        host does not), then average."""
        self._active = False
        while self._next < len(self.bounds):
            self._start()
        for work in self._works:
            work.wait()
        self._works = []
        self.flat.div_(self.world_size)

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
