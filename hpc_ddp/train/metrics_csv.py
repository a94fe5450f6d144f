"""metrics.csv (``--metrics csv``): one header, then a row per progress line and per epoch.

The columns are metrics.jsonl's fields, nested tables flattened (``time_data``...), after
``record`` (``step`` or ``epoch``). A progress line's row has its step's loss in ``train_loss``,
``lr`` and ``samples_per_second``, and leaves the evaluation columns empty; an epoch's row is
metrics.jsonl's line. Lists (``test_samples_per_rank``) are written as JSON.

Opening continues the file at a resumed step S (metric_writers.py says why): it is read, rows of
steps before S are kept, and header, kept rows and the checkpoint's records of S replace it at
once (private_paths.replace_file). A last line without its newline is a row torn by a kill and is
dropped, so nothing is ever appended after half a row. Rows are then appended, one write each.

Columns someone added (a note beside a row) are carried: they follow the trainer's in the
header, with their values in the kept rows, empty in new ones. A file whose content the rewrite
would lose is refused instead, naming what and how to proceed: a column named twice, a row with
more fields than the header, a value in an added column of a row that the resume drops.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpc_ddp.errors import ConfigError
from hpc_ddp.private_paths import replace_file
from hpc_ddp.regular_file import open_regular, read_capped
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
# The most metrics.csv may hold when it is read back: about a million rows. The bound only stops
# a planted file from making rank 0 load without end; a field may be as long as the file (csv's
# default limit of 128 KiB would refuse a long note or a list of many ranks' sample counts).
SIZE_LIMIT = 256 << 20
_MOVE_IT = (
    "move it out of the run dir (the trainer then writes a new one), or leave csv out of --metrics"
)


def format_rows(
    rows: Iterable[Mapping[str, Any]], columns: Sequence[str] = COLUMNS, *, header: bool = False
) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, columns, extrasaction="ignore", lineterminator="\n")
    if header:
        writer.writeheader()
    for row in rows:
        writer.writerow({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()})
    return out.getvalue()


@dataclass
class Existing:
    """What a resume keeps of metrics.csv: the columns the trainer does not write (in the
    file's order) and the complete rows logged before the resumed step."""

    added: list[str] = field(default_factory=list)
    kept: list[dict[str, str]] = field(default_factory=list)


def _read_text(path: Path) -> str | None:
    try:
        with open_regular(path) as f:
            return read_capped(f, SIZE_LIMIT, path).decode()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as err:
        raise _not_ours(path, f"cannot be read back ({err})") from None


def _records(path: Path, text: str) -> list[tuple[int, list[str]]]:
    """(line number, fields) of each non-blank record, fields as long as the file allows."""
    limit = csv.field_size_limit()
    csv.field_size_limit(SIZE_LIMIT)  # the process's setting, put back before anything else runs
    reader = csv.reader(io.StringIO(text))
    try:
        return [(reader.line_num, fields) for fields in reader if fields]
    except csv.Error as err:
        raise _not_ours(path, f"line {reader.line_num} is not CSV ({err})") from None
    finally:
        csv.field_size_limit(limit)


def read_back(path: Path, step: int) -> Existing:
    """What the resume at ``step`` keeps of ``path`` (nothing if it does not exist); ConfigError
    for a file that the trainer did not write or whose rewrite would lose someone's values."""
    text = _read_text(path)
    if not text:
        return Existing()
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]  # a torn last row (or a torn header: nothing kept)
    records = _records(path, text)
    if not records:
        return Existing()
    header = records[0][1]
    if not set(_KEYS) <= set(header):
        raise _not_ours(path, f"has no {' and '.join(_KEYS)} columns")
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise _not_ours(path, f"names the column(s) {', '.join(map(repr, twice))} twice")
    added = [name for name in header if name not in COLUMNS]
    found = Existing(added)
    for line, fields in records[1:]:
        if len(fields) > len(header):
            raise _not_ours(
                path, f"line {line} has {len(fields)} fields, more than the header's {len(header)}"
            )
        row = dict(zip(header, fields, strict=False))  # a short row: the rest empty
        try:
            logged_at = int(row["step"])
        except (KeyError, ValueError):
            raise _not_ours(path, f"line {line} has no step number") from None
        if logged_at < step:
            found.kept.append(row)
            continue
        theirs = [name for name in added if row.get(name)]
        if theirs:
            raise ConfigError(
                f"{path} line {line} (step {logged_at}) has a value in the column(s) "
                f"{', '.join(map(repr, theirs))}, which the trainer does not write: the run "
                f"goes on from step {step} (its newest checkpoint, or the start) and rewrites "
                "the file without the rows of that step and later, which it logs again; the "
                "value would be lost",
                hint=f"copy what those columns hold in the rows of step {step} and later "
                "elsewhere and empty them in the file, or move the file out of the run dir "
                "(the trainer then writes a new one)",
            )
    return found


def _not_ours(path: Path, why: str) -> ConfigError:
    return ConfigError(
        f"{path} {why}: it is not a metrics.csv that the trainer wrote", hint=_MOVE_IT
    )


class CsvWriter:
    """Rank 0's metrics.csv, open for appending."""

    def __init__(self, fd: int, columns: Sequence[str] = COLUMNS) -> None:
        self.fd: int | None = fd
        self.columns = columns

    @classmethod
    def open(cls, path: Path, resumed_step: int, again: list[Record]) -> CsvWriter:
        found = read_back(path, resumed_step)
        columns = (*COLUMNS, *found.added)
        text = format_rows(found.kept, columns, header=True)
        text += format_rows((r.flat() for r in again), columns)
        replace_file(path, text.encode())
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
        return cls(os.open(path, flags), columns)

    def write(self, record: Record) -> None:
        if self.fd is None:
            return
        view = memoryview(format_rows([record.flat()], self.columns).encode())
        while view:
            view = view[os.write(self.fd, view) :]

    def flush(self) -> None:
        pass  # every row went to the file (unbuffered os.write) when it was logged

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
