"""metrics.csv (``--metrics csv``): one header, then a row per progress line and per epoch.

The columns are metrics.jsonl's fields, nested tables flattened (``time_data``...), after
``record`` (``step`` or ``epoch``). A progress line's row has its step's loss in ``train_loss``,
``lr`` and ``samples_per_second``, and leaves the evaluation columns empty; an epoch's row is
metrics.jsonl's line. Lists (``test_samples_per_rank``) are written as JSON.

Opening continues the file at a resumed step S (metric_writers.py says why): it is read, rows of
steps before S are kept, and header, kept rows and the checkpoint's records of S replace it at
once (private_paths.replace_file). A last line without its newline is a row torn by a kill and is
dropped, so nothing is ever appended after half a row. Rows are then appended, one write each.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from hpc_ddp.errors import ConfigError
from hpc_ddp.private_paths import replace_file
from hpc_ddp.regular_file import open_regular
from hpc_ddp.train.metric_records import Record

COLUMNS = (
    "record",
    "epoch",
    "step",
    "train_loss",
    "lr",
    "samples_per_second",
    "test_loss",
    "test_accuracy",
    "test_samples",
    "test_samples_per_rank",
    "seconds",
    "allreduce_calls",
    "time_data",
    "time_compute",
    "time_comm",
    "time_checkpoint",
    "time_eval",
)
_KEYS = ("record", "step")  # a file without these columns is not one the trainer wrote


def format_rows(rows: Iterable[Mapping[str, Any]], *, header: bool = False) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, extrasaction="ignore", lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    return out.getvalue()


def rows_before(path: Path, step: int) -> list[dict[str, str]]:
    """The complete rows of ``path`` (if it exists) logged before ``step``."""
    try:
        with open_regular(path) as f:
            text = f.read().decode()
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError) as err:
        raise _not_ours(path, f"cannot be read back ({err})") from None
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # a torn last row (or a torn header: nothing kept)
    reader = csv.DictReader(io.StringIO(text))
    if text and not set(_KEYS) <= set(reader.fieldnames or ()):
        raise _not_ours(path, f"has no {' and '.join(_KEYS)} columns")
    kept = []
    for row in reader:
        try:
            logged_at = int(row["step"])
        except (TypeError, ValueError):
            raise _not_ours(path, f"line {reader.line_num} has no step number") from None
        if logged_at < step:
            kept.append(row)
    return kept


def _not_ours(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} {why}: it is not a metrics.csv that the trainer wrote",
        hint="move it out of the run dir (the trainer then writes a new one), or leave csv out "
        "of --metrics",
    )


class CsvWriter:
    """Rank 0's metrics.csv, open for appending."""

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd

    @classmethod
    def open(cls, path: Path, resumed_step: int, again: list[Record]) -> CsvWriter:
        kept = rows_before(path, resumed_step)
        text = format_rows(kept, header=True) + format_rows(r.flat() for r in again)
        replace_file(path, text.encode())
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        return cls(os.open(path, flags))

    def write(self, record: Record) -> None:
        if self.fd is None:
            return
        view = memoryview(format_rows([record.flat()]).encode())
        while view:
            view = view[os.write(self.fd, view) :]

    def flush(self) -> None:
        pass  # every row went to the file (unbuffered os.write) when it was logged

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
