"""Where rank 0's metrics go (``--metrics jsonl,csv,tensorboard``), one run across its attempts.

A *record* (metric_records.py) is what rank 0 logs: a progress line or a finished epoch. Each
format has a writer. Every attempt of a run (requeued, resumed, or started again after a crash)
writes into the same files, and a resume from the checkpoint of step S leaves them as if the run
had never stopped:

- records of steps before S stay: each was written before that checkpoint was, and the trainer
  flushes the writers before every save, so a SIGKILL after the save cannot lose them;
- records of step S and later are dropped: a run killed hard (SIGKILL, a lost node) may have
  logged steps after its last checkpoint, which the resumed run logs again;
- the records of step S itself are written again from the checkpoint, which holds them
  (``Progress.last_log`` and ``Progress.history``): the epoch row at S is written after the
  epoch-end save started, so the files may or may not have it.

The writers of csv and tensorboard are imported only when asked for (tensorboard imports torch);
only rank 0 opens any.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from hpc_ddp import extras, regular_file
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.train import results
from hpc_ddp.train.metric_records import Record, records_at

if TYPE_CHECKING:  # progress.py imports torch, which the jsonl and csv writers do not need
    from hpc_ddp.train.progress import Progress


class Writer(Protocol):
    def write(self, record: Record) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class JsonlWriter:
    """metrics.jsonl: one line per epoch, rewritten whole from the epochs so far at each one
    (results.write_metrics), so that a resume never duplicates a line."""

    def __init__(self, paths: RunPaths, history: Iterable[Mapping[str, Any]]) -> None:
        self.root = paths.root
        self.rows = [dict(row) for row in history]
        if _check_ours(paths.metrics):  # it may hold an epoch past the checkpoint: rewrite it now
            results.write_metrics(self.root, self.rows)

    def write(self, record: Record) -> None:
        if record.kind == "epoch":
            self.rows.append(dict(record.row))
            results.write_metrics(self.root, self.rows)

    def flush(self) -> None:
        pass  # each write replaced the whole file

    def close(self) -> None:
        pass


# metrics.jsonl holds a line of a few hundred bytes per epoch; the bound only stops a planted
# file from making rank 0 load without end.
JSONL_LIMIT = 64 << 20


def _check_ours(path: Path) -> bool:
    """Whether metrics.jsonl exists; ConfigError if what is there is not one the trainer wrote
    (a directory, or lines that are not its epochs), which the rewrite would replace."""
    try:
        text = regular_file.read_small(path, JSONL_LIMIT)
    except FileNotFoundError:
        return False
    except regular_file.NotRegularFileError:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return True  # a link, a FIFO: replaced, never written through nor read
        why = "is a directory"
    except OSError as err:
        why = f"cannot be read back ({err})"
    else:
        why = _not_epochs(text)
        if not why:
            return True
    raise ConfigError(
        f"{path} {why}: it is not a metrics.jsonl that the trainer wrote, and the trainer "
        "writes its own there",
        hint="move it out of the run dir (the trainer then writes a new one)",
    )


def _not_epochs(text: bytes) -> str:
    """Why ``text`` is not metrics.jsonl's lines, "" if it is (the file is always replaced
    whole: no line of ours is torn)."""
    for number, line in enumerate(text.split(b"\n"), start=1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            return f"line {number} is not JSON"
        if not (isinstance(row, dict) and "epoch" in row and "step" in row):
            return f"line {number} is not an epoch's record (an object with epoch and step)"
    return ""


class MetricWriters:
    """The writers of one rank: none on ranks other than 0."""

    def __init__(self, writers: list[Writer]) -> None:
        self.writers = writers

    def write(self, record: Record) -> None:
        for writer in self.writers:
            writer.write(record)

    def flush(self) -> None:
        """Before a checkpoint: what was logged is on disk before the checkpoint is."""
        for writer in self.writers:
            writer.flush()

    def close(self) -> None:
        writers, self.writers = self.writers, []
        for writer in writers:
            writer.close()


def check_installed(formats: Iterable[str]) -> None:
    """A format whose package is missing is refused at startup, naming the extra to install."""
    if "tensorboard" in formats:
        extras.require("tensorboard", "--metrics tensorboard")


def open_writers(formats: Iterable[str], paths: RunPaths, progress: Progress) -> MetricWriters:
    """Rank 0: open the writers of ``formats``, continuing the files at ``progress`` (the
    restored checkpoint's, or a fresh run's): see the module docstring."""
    formats = list(formats)
    resumed, again = progress.global_step, records_at(progress)
    writers: list[Writer] = [JsonlWriter(paths, progress.history)]
    try:
        if "csv" in formats:
            from hpc_ddp.train.metrics_csv import CsvWriter

            writers.append(CsvWriter.open(paths.metrics_csv, resumed, again))
        if "tensorboard" in formats:
            from hpc_ddp.train.metrics_tensorboard import TensorBoardWriter

            writers.append(TensorBoardWriter.open(paths.tensorboard, resumed, again))
    except BaseException:
        MetricWriters(writers).close()
        raise
    return MetricWriters(writers)
