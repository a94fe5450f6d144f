"""A metrics record: what rank 0 logs, as every metrics writer (metric_writers.py) takes it.

A progress line (``step``: that step's loss, the learning rate, samples/s) or a finished epoch
(``epoch``: metrics.jsonl's row). A checkpoint holds the records of its own step (the last
progress line's in ``Progress.last_log``, the epochs' in ``Progress.history``), so a resume from
it can write them again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # progress.py imports torch, which records do not need
    from hpc_ddp.train.progress import Progress

RecordKind = Literal["step", "epoch"]


@dataclass(frozen=True)
class Record:
    """One logged record: ``row`` is a progress line's values or metrics.jsonl's row."""

    kind: RecordKind
    row: Mapping[str, Any]

    @property
    def step(self) -> int:
        return int(self.row["step"])

    def flat(self) -> dict[str, Any]:
        """``record`` (the kind) and the row with nested tables flattened: ``time_data``..."""
        out: dict[str, Any] = {"record": self.kind}
        for key, value in self.row.items():
            if isinstance(value, Mapping):
                out.update({f"{key}_{k}": v for k, v in value.items()})
            else:
                out[key] = value
        return out


def step_record(progress: Progress, loss: float, lr: float, rate: float) -> Record:
    """A progress line's record (what ``log_every`` prints), kept in ``progress.last_log``."""
    row = {"epoch": progress.epoch + 1, "step": progress.global_step, "train_loss": loss,
           "lr": lr, "samples_per_second": rate}  # fmt: skip
    return Record("step", row)


def records_at(progress: Progress) -> list[Record]:
    """The records a checkpoint holds of its own step, in the order they were logged."""
    step = progress.global_step
    found = [Record("step", progress.last_log)] if progress.last_log else []
    found += [Record("epoch", row) for row in progress.history]
    return [record for record in found if record.step == step]
