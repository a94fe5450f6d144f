"""Which epoch ends write a checkpoint.

Every one when epochs are long; when they are short, one once ``checkpoint_interval_s`` seconds
of training have passed since the newest checkpoint, so that a save's cost on the training path
and beside it, which a sub-second epoch cannot absorb (benchmarks/NOTES.md), stays under 1 % of
training. The last epoch's end always saves, and so do preemptions and ``checkpoint_every_steps``.

Every rank must enter a save's collectives or none: the decision uses only values all ranks
hold identically, the global step and the ranks' mean pace agreed at the last sync point
(syncpoints.AgreeSchedule.agreed_pace), never a rank's own clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EpochEndSaves:
    """The epoch-end saving policy of one run (one attempt: ``since_step`` is where it began)."""

    interval_s: float  # TrainConfig.checkpoint_interval_s; 0 saves every epoch end
    since_step: int = 0  # global step of the newest checkpoint, or of this attempt's start
    told: bool = False  # the one log line about thinned saves was written
    trained_s: float = 0.0  # training since the newest checkpoint, at the last decision

    def due(self, step: int, pace: float, *, final: bool) -> bool:
        """Whether the epoch ending at global ``step`` saves, at ``pace`` agreed seconds/step
        (<= 0: not measured yet, so it saves)."""
        self.trained_s = (step - self.since_step) * pace
        if final or self.interval_s <= 0 or pace <= 0:
            return True
        return self.trained_s >= self.interval_s

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was written (at an epoch end or elsewhere)."""
        self.since_step = step

    def first_skip(self) -> bool:
        """True once: at the first epoch end that does not save (the run says why)."""
        told, self.told = self.told, True
        return not told
