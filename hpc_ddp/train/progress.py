"""Progress: where training stands; in every checkpoint, so a resume continues every counter.
And the live bar rank 0 shows on a terminal while it trains."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from hpc_ddp.train.loop import Times


@dataclass
class Progress:
    epoch: int = 0  # current epoch (0-based)
    start: int = 0  # GLOBAL samples of this epoch already trained on (a step boundary)
    global_step: int = 0
    epoch_loss_sum: float = 0.0
    epoch_loss_count: float = 0.0
    epoch_times: dict[str, float] = field(default_factory=lambda: Times().to_dict())
    samples_total: int = 0  # global training samples over all attempts
    train_seconds: float = 0.0  # time inside steps over all attempts
    wall_seconds: float = 0.0  # wall time up to the last checkpoint
    train_wall_seconds: float = 0.0  # of it, in the training loop (resume.Clock)
    interruptions: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one metrics row per epoch
    # The last progress line's record (metric_writers.step_record): a resume from this
    # checkpoint writes it again, with the epoch row of the same step.
    last_log: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of it. Shallow: a save writes it at once, a background save
        copies it; a deep copy would first copy the growing history on the training thread."""
        return vars(self).copy()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(vars(Progress(**state)))  # every field checked by the constructor


def wants_live_bar(stream: TextIO, environ: Mapping[str, str]) -> bool:
    """A terminal that asked for nothing plainer: not a pipe or a log file, no ``NO_COLOR``
    (https://no-color.org: any non-empty value), no ``TERM=dumb``."""
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False
    return tty and not environ.get("NO_COLOR") and environ.get("TERM") != "dumb"


class LiveBar:
    """Rank 0 on a terminal: one line redrawn in place with ``\\r`` (epoch, step, a bar, the
    last agreed loss, samples/s), at most ``HZ`` times a second. The plain progress lines are
    printed as without the bar, each after clearing it, so a terminal shows both and a log file or
    pipe (no bar there) keeps plain lines only."""

    HZ = 10.0
    WIDTH = 24  # characters of the bar itself

    def __init__(self, stream: TextIO, epochs: int, global_batch: int) -> None:
        self.stream, self.epochs, self.global_batch = stream, epochs, global_batch
        self.loss: float | None = None  # set at sync points: the step loss stays on the device
        self._shown = 0  # characters of the bar now on screen
        self._drawn_at = float("-inf")
        self._first: tuple[float, int] | None = None  # (time, steps done) of the first update

    def update(self, epoch: int, done: int, steps: int) -> None:
        now = time.monotonic()
        total = (epoch - 1) * steps + done
        if self._first is None:
            self._first = (now, total)
        if now - self._drawn_at < 1.0 / self.HZ and done != steps:
            return
        self._drawn_at = now
        t0, done0 = self._first
        filled = self.WIDTH * done // max(steps, 1)
        text = f"epoch {epoch}/{self.epochs} [{'#' * filled}{'.' * (self.WIDTH - filled)}] "
        text += f"step {done}/{steps}"
        if self.loss is not None:
            text += f" loss {self.loss:.4f}"
        if total > done0:  # a rate needs a step after the first
            text += f" {(total - done0) * self.global_batch / max(now - t0, 1e-9):.0f} samples/s"
        self._write("\r" + text.ljust(self._shown))
        self._shown = len(text)

    def clear(self) -> None:
        """Before a plain line: blank the bar and return to the line's start."""
        if self._shown:
            self._write("\r" + " " * self._shown + "\r")
            self._shown = 0

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()
