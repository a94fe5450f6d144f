"""How ranks agree during a save or a load, without ever waiting on a rank that has given up.

A plain barrier is not enough: a rank that hit a full disk must not leave the others waiting in
a barrier it will never reach, nor let them commit a checkpoint without its file. Every phase
therefore ends with ``all_ok = agree(local_ok)`` (an all-reduce MIN), which every rank reaches
whether its own phase succeeded or not; then all raise together or all go on together.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Agree = Callable[[bool], bool]


def _device() -> torch.device:
    # NCCL only reduces CUDA tensors; Gloo (and the CPU half of "cpu:gloo,cuda:nccl") CPU ones.
    backend = str(dist.get_backend())
    if backend == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def dist_same_int(value: int) -> bool:
    """True on every rank iff every rank passed the same value (MIN of v and of -v)."""
    t = torch.tensor([value, -value], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t[0]) == -int(t[1])


def dist_failed_ranks(ok: bool, group: dist.ProcessGroup | None = None) -> list[int]:
    """Every rank learns which ranks reported failure (an all-reduce SUM of a one-hot vector:
    one int per rank, 40 KB even at 10,000 ranks). ``group``: a Gloo group (CPU tensor), or
    None for the default group."""
    if group is None:
        t = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=_device())
        t[dist.get_rank()] = 0 if ok else 1
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    else:
        t = torch.zeros(dist.get_world_size(group), dtype=torch.int32)
        t[dist.get_rank(group)] = 0 if ok else 1
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [r for r, failed in enumerate(t.tolist()) if failed]


def dist_ready(world_size: int) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() == world_size


# (all ranks ok, who failed in words) - the words go into the error raised on healthy ranks.
Agreement = Callable[[bool], tuple[bool, str]]


def choose_agree(
    world_size: int,
    agree: Agree | None,
    barrier: Callable[[], None],
    group: dist.ProcessGroup | None = None,
) -> Agreement:
    """The agreement to use: the caller's, else the process group's (``group``, or the default
    one), else the barrier's.

    The barrier-only fallback cannot tell the others that one rank failed; even then no partial
    checkpoint appears, because rank 0 refuses to commit unless every rank's file is present.
    """
    if agree is not None:
        custom = agree
        return lambda ok: (custom(ok), "another rank")
    if world_size == 1:
        return lambda ok: (ok, "")
    if dist_ready(world_size):

        def with_names(ok: bool) -> tuple[bool, str]:
            failed = dist_failed_ranks(ok, group)
            return not failed, f"rank(s) {', '.join(map(str, failed[:16]))}"

        return with_names

    def barrier_then_local(ok: bool) -> tuple[bool, str]:
        barrier()
        return ok, "another rank"

    return barrier_then_local
