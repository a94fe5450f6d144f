"""tensorboard/ (``--metrics tensorboard``): TensorBoard event files, one per attempt of the run.

Each record's numbers become scalars at its global step, tagged ``step/<field>`` for progress
lines and ``epoch/<field>`` for epochs (metrics.jsonl's fields, ``time`` flattened as in
metrics.csv). ``epoch`` and ``step`` themselves are the x axis, and lists are left out.

A resume from step S opens its event file with ``purge_step=S``: the file starts with a marker
telling TensorBoard to discard what earlier files hold at steps >= S (its documented way to
continue a crashed run), and the checkpoint's records of S are written again after it. TensorBoard
reads a run's event files in name order, and a name starts with its creation second: opening
waits, at most ``_NAME_WAIT_S``, until this attempt's name sorts after every earlier one's.
"""

from __future__ import annotations

import os
import re
import stat
import time
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING

from hpc_ddp.errors import ConfigError
from hpc_ddp.polling import poll_until
from hpc_ddp.train.metric_records import Record

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

_EVENT_FILE = re.compile(r"events\.out\.tfevents\.([0-9]{10})\..*")
_NAME_WAIT_S = 1.5
_AXES = ("record", "epoch", "step")


def scalars(record: Record) -> dict[str, float]:
    """The record's numbers by their TensorBoard tags."""
    return {
        f"{record.kind}/{key}": float(value)
        for key, value in record.flat().items()
        if key not in _AXES and isinstance(value, Real) and not isinstance(value, bool)
    }


def _log_dir(path: Path) -> Path:
    """``path`` as a directory of our own making: never through a link planted there, never in
    place of a file."""
    hint = (
        "move it out of the run dir (the trainer then creates the directory), or leave "
        "tensorboard out of --metrics"
    )
    try:
        path.mkdir()
    except FileExistsError:
        pass  # a directory of an earlier attempt, or something else: lstat says which
    except OSError as err:
        raise ConfigError(
            f"cannot create {path} for TensorBoard's files: {err.strerror}", hint=hint
        ) from None
    mode = os.lstat(path).st_mode
    if not stat.S_ISDIR(mode):
        if stat.S_ISLNK(mode):
            what = "a symbolic link" if path.exists() else "a symbolic link to nothing"
        else:
            what = "a file" if stat.S_ISREG(mode) else "a FIFO, socket or device"
        raise ConfigError(
            f"{path} is {what}, not a directory: TensorBoard's files go there", hint=hint
        )
    return path


def _wait_to_sort_last(log_dir: Path) -> None:
    newest = max(
        (int(m.group(1)) for name in os.listdir(log_dir) if (m := _EVENT_FILE.fullmatch(name))),
        default=-1,
    )
    # The clock's next second; bounded by the deadline (clock skew).
    poll_until(lambda: int(time.time()) > newest, _NAME_WAIT_S, interval_s=0.05)


class TensorBoardWriter:
    """Rank 0's event file of this attempt."""

    def __init__(self, writer: SummaryWriter) -> None:
        self.writer: SummaryWriter | None = writer

    @classmethod
    def open(cls, path: Path, resumed_step: int, again: list[Record]) -> TensorBoardWriter:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = _log_dir(path)
        _wait_to_sort_last(log_dir)
        opened = cls(SummaryWriter(str(log_dir), purge_step=resumed_step))
        for record in again:
            opened.write(record)
        return opened

    def write(self, record: Record) -> None:
        if self.writer is None:
            return
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record.step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()  # returns once the queued events are in the file

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
