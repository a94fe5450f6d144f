"""Where training synchronises the host with the devices and the ranks with each other.

A step's loss stays on the device; nothing in a step waits for the GPU. The ranks meet at *sync
points*, and only there: one all-reduce carries the per-step loss sums and sample counts of every
step since the last sync point (in step order), the preemption vote and each rank's recent pace,
and one host read takes the result. Reading the loss every step would cost a host sync per step:
the CPU could not queue step s+1 while the GPU finished step s, a sizeable share of a step,
eager or captured (benchmarks/NOTES.md).

Sync points are a function of the step count and of values every rank holds identically (the
config, the result of the previous all-reduce), so all ranks enter the same collectives:
- the epoch's last step, log points (``log_every``), in-epoch checkpoint steps, the test hook
  ``debug_hold_at_step``: where a value must be known (the log line, a checkpoint's progress);
- agreement points (``AgreeSchedule``) for the preemption flag: every ``k`` steps with ``k`` set
  from the measured pace so that ``k`` steps take about ``AGREE_TARGET_S`` seconds, at most
  ``AGREE_MAX_STEPS``. A signal thus leads to a checkpoint after at most ``k`` more steps
  (docs/training.md has the bound). One process needs no agreement: it reads its own flag after
  every step and syncs only when it is set.

Results do not depend on where sync points fall: the losses are folded into the epoch's sums in
step order, in float64, exactly as when each step was reduced on its own (bit-identical for one or
two ranks; with three or more, a ring all-reduce may add a step's rank values in another order
than for a 3-element message, a last-bit difference in the logged loss only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hpc_ddp import Comm

AGREE_TARGET_S = 0.25  # seconds of training between two preemption agreements, about
AGREE_MAX_STEPS = 64  # and never more steps than this


@dataclass
class AgreeSchedule:
    """At which global steps the ranks agree on the preemption flag (several ranks only)."""

    world_size: int
    target_s: float = AGREE_TARGET_S
    max_steps: int = AGREE_MAX_STEPS
    next_step: int = 0  # the first step after (re)start agrees
    pace: float = -1.0  # this rank's seconds per step over the last full interval; -1 unknown
    agreed_pace: float = -1.0  # the ranks' mean pace from the last sync point: the same on all
    _mark: float | None = field(default=None, repr=False)
    _mark_step: int = 0

    def due(self, step: int, requested: bool) -> bool:
        """Whether ``step`` must be a sync point for the flag (``requested``: this rank's own)."""
        if self.world_size == 1:
            return requested  # no one to agree with: act at this step boundary
        return step >= self.next_step

    def interval(self, pace: float) -> int:
        """Steps until the next agreement at ``pace`` seconds per step (all ranks' mean)."""
        if pace <= 0:
            return 1
        return max(1, min(self.max_steps, int(self.target_s / pace)))

    def start_epoch(self, step: int) -> None:
        """Measure the pace from here: evaluation and checkpoints are not training steps."""
        self._mark, self._mark_step = time.perf_counter(), step

    def synced(self, step: int, pace: float) -> None:
        """After a sync point at ``step``: plan the next agreement, measure the pace from here."""
        now = time.perf_counter()
        if self._mark is not None and step > self._mark_step:
            self.pace = (now - self._mark) / (step - self._mark_step)
        self._mark, self._mark_step = now, step
        self.agreed_pace = pace
        self.next_step = step + self.interval(pace)


@dataclass
class PendingSteps:
    """The steps since the last sync point: device loss sums and sample counts, in step order."""

    losses: list[torch.Tensor] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, loss_sum: torch.Tensor, n: int) -> None:
        self.losses.append(loss_sum)
        self.counts.append(n)

    def reduce(
        self, comm: Comm, preempt: float, pace: float
    ) -> tuple[list[float], list[float], float, float]:
        """One all-reduce SUM and one host read; empties the list.

        Returns (global loss sum per step, global samples per step, preemption votes, the
        ranks' mean pace).
        """
        k = len(self.losses)
        host = torch.tensor([*map(float, self.counts), preempt, pace], dtype=torch.float64)
        losses = torch.stack(self.losses).to(device=comm.device, dtype=torch.float64)
        values = comm.sum_tensor(torch.cat([losses, host.to(comm.device)]))  # the one host sync
        self.losses.clear()
        self.counts.clear()
        return values[:k], values[k : 2 * k], values[2 * k], values[2 * k + 1] / comm.world_size
