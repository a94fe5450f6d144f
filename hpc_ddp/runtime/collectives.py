"""The few collectives the trainer needs, as no-ops when there is no process group (1 process)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hpc_ddp.dist import report_error
from hpc_ddp.errors import HpcDdpError


class PeerFailed(HpcDdpError):
    """Another rank reported an error in a step all ranks take together; its log says which.
    Exits with that rank's code (``Comm.check`` sets it), 1 where unknown."""

    exit_code = 1


class Comm:
    """Collectives on tensors that live on ``device`` (NCCL needs CUDA tensors, Gloo CPU ones)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.active = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.active else 0
        self.world_size = dist.get_world_size() if self.active else 1

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks, in float64 so counts stay exact."""
        return self.sum_tensor(torch.tensor(values, dtype=torch.float64, device=self.device))

    def sum_tensor(self, t: torch.Tensor) -> list[float]:
        """``sum`` of values already in a tensor (on any device: no host read before the
        all-reduce); the one host read is the result's."""
        return self._reduce(t, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks."""
        return self._reduce(torch.tensor(values, dtype=torch.float64), dist.ReduceOp.MAX)

    def _reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> list[float]:
        t = t.to(self.device)
        if self.active:
            dist.all_reduce(t, op=op)
        return t.tolist()

    def barrier(self) -> None:
        if self.active:
            # A tiny all_reduce, not dist.barrier(): NCCL's barrier guesses a device.
            self.sum([0.0])

    def broadcast_buffers(self, module: torch.nn.Module) -> None:
        """Give every rank rank 0's buffers (BatchNorm statistics), as DDP does each forward."""
        if self.active:
            for buf in module.buffers():
                dist.broadcast(buf, src=0)

    def gather_objects(self, obj: Any) -> list[Any]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def check(self, error: BaseException | None, what: str) -> None:
        """All ranks agree whether any rank failed ``what``; every rank then raises.

        Without this, one rank failing alone (a locked run dir, a missing dataset) would leave
        the others waiting in their next collective until the timeout. The failing ranks print
        their errors before a second collective that the others wait in: the cause comes first
        in a merged log, before any rank's "another rank failed" (each error is printed once).
        That collective also gives the others the failing ranks' exit code (2 for bad input),
        so the job's code is the cause's whichever rank exits first.
        """
        failed = self.sum([1.0 if error is not None else 0.0])[0]
        if not failed:
            return
        code = 0.0
        if error is not None:
            code = float(report_error(error))
        code = self.max([code])[0]
        if error is not None:
            raise error
        peer = PeerFailed(f"{int(failed)} other rank(s) failed while {what}; see their errors")
        peer.exit_code = int(code)
        raise peer
