"""The toolkit's logger: every rank logs, rank 0's records are the run's log.

Records of ranks other than 0 are dropped unless they are warnings or errors, so a job of 64
processes prints its progress once while another node's failure still reaches the log, marked
with its rank. Records go to stdout (looked up at each record, so redirections and pytest's
capture see them) as bare messages: the lines users and scripts read (progress, results,
``CUDA graphs: ...``) keep their text.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

NAME = "hpc_ddp"
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")


def _rank_from_env() -> int:
    for var in _RANK_VARS:
        value = os.environ.get(var, "")
        if value.isdigit():
            return int(value)
    return 0


class RankFilter(logging.Filter):
    """Keeps rank 0's records and the warnings and errors of every other rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = f"[rank {self.rank}] " if self.rank else ""
        return self.rank == 0 or record.levelno >= logging.WARNING


class _StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler on whatever ``sys.stdout`` is now (not the one at import), flushed."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stdout
        super().emit(record)


_filter = RankFilter(_rank_from_env())


def _install() -> logging.Logger:
    logger = logging.getLogger(NAME)
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
        handler.addFilter(_filter)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # one copy of each line, whatever the application configures
    return logger


class _BeforeLine(logging.Filter):
    """Runs a hook just before a record that passed the rank filter is written."""

    def __init__(self, hook: Callable[[], None]) -> None:
        super().__init__()
        self.hook = hook

    def filter(self, record: logging.LogRecord) -> bool:
        self.hook()
        return True


def before_each_line(hook: Callable[[], None]) -> Callable[[], None]:
    """Call ``hook`` before each line the log writes (a live progress bar clears itself there);
    returns the function that removes it."""
    handler = next(h for h in _install().handlers if isinstance(h, _StdoutHandler))
    line_filter = _BeforeLine(hook)
    handler.addFilter(line_filter)  # after the rank filter: only for lines that are written
    return lambda: handler.removeFilter(line_filter)


def set_rank(rank: int) -> None:
    """This process's rank, once the process group knows it (the environment's until then)."""
    _filter.rank = rank


def get_logger(name: str | None = None) -> logging.Logger:
    """``hpc_ddp`` (or ``hpc_ddp.<name>``), writing through the rank filter."""
    root = _install()
    return root.getChild(name) if name else root
