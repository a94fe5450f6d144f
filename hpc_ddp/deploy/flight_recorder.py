"""NCCL flight recorder: switched on in rendered GPU jobs, and its dumps read back.

PyTorch's ProcessGroupNCCL keeps a ring buffer of the last collectives of every rank (the
"flight recorder"). With ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` a rank whose collective times out
writes that buffer, and asks every other rank to write theirs, to
``<TORCH_FR_DUMP_TEMP_FILE><rank>``. (torch 2.14 reads ``TORCH_FR_BUFFER_SIZE`` and
``TORCH_FR_DUMP_TEMP_FILE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` are their deprecated names.) A hang then leaves one file per
rank in the run directory instead of nothing.

A dump is a pickle of plain data: ``{"version": "2.x", "pg_config": {...}, "entries": [...]}``,
each entry a dict with ``record_id``, ``collective_seq_id``, ``profiling_name``
(``nccl:all_reduce``), ``state`` (scheduled/started/completed), ``input_sizes``,
``process_group`` and more (torch's c10d FlightRecorder ``dump_entries``). Data never becomes
code: it is read with an unpickler that refuses every global, so only dicts, lists, tuples,
strings, numbers and None can come out; torch's own reader (torch.distributed.flight_recorder)
calls ``pickle.load``, which can run code. Torch-free.
"""

from __future__ import annotations

import io
import json
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.run_paths import FR_DUMP_FILE_VAR, NCCL_TRACE, RunPaths

DUMP_PREFIX = "rank_"
# Entries kept per rank: enough to cover a few training steps of a DDP model (one all-reduce
# per gradient bucket), small enough to cost nothing (torch's own suggestion is 2000).
BUFFER_ENTRIES = 2000
_MAX_DUMP_BYTES = 256 * 1024 * 1024
_RANK = re.compile(r"(\d+)")


def flight_recorder_env(
    trainer_args: Sequence[str], *, runs_trainer: bool = True
) -> dict[str, str]:
    """The variables a GPU job sets: buffer on, dump on timeout, dumps in the run directory
    (``<run_dir>/nccl_trace/rank_<N>``; relative to the job's working directory, like the run
    dir itself). torch does not create the directory: the trainer's rank 0 does, at start."""
    base = NCCL_TRACE
    if runs_trainer:
        from hpc_ddp.deploy.trainer_args import trainer_flags

        run_dir = getattr(trainer_flags(trainer_args), "run_dir", None)
        if run_dir is None:
            from hpc_ddp.train.config import TrainConfig

            run_dir = TrainConfig().run_dir
        base = f"{run_dir.rstrip('/')}/{NCCL_TRACE}"
    return {
        "TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        FR_DUMP_FILE_VAR: f"{base}/{DUMP_PREFIX}",
    }


class _PlainData(pickle.Unpickler):
    """Builds containers and scalars only: any class or function reference is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a dump holds plain data only")


@dataclass(frozen=True)
class Collective:
    seq: int
    op: str
    state: str
    sizes: list[Any]
    group: str


@dataclass(frozen=True)
class RankTrace:
    rank: int
    version: str
    entries: list[Collective]

    @property
    def last_entered(self) -> Collective | None:
        return self.entries[-1] if self.entries else None

    @property
    def last_completed(self) -> Collective | None:
        done = [e for e in self.entries if e.state == "completed"]
        return done[-1] if done else None


def read_dump(path: Path) -> RankTrace:
    """One rank's dump; ConfigError naming the file if it is not a flight recorder dump."""
    match = _RANK.search(path.name[::-1])
    if match is None:
        raise ConfigError(f"{path}: no rank number at the end of the file name")
    rank = int(match.group(1)[::-1])
    data = path.read_bytes()
    if len(data) > _MAX_DUMP_BYTES:
        raise ConfigError(f"{path}: {len(data)} bytes is too large for a flight recorder dump")
    try:
        dump = _PlainData(io.BytesIO(data)).load()
    except Exception as err:  # any malformed pickle: say which file and why
        raise ConfigError(
            f"{path}: not a readable flight recorder dump ({err})",
            hint="pass the files TORCH_FR_DUMP_TEMP_FILE names (<run_dir>/nccl_trace/rank_N)",
        ) from None
    if not isinstance(dump, Mapping) or not isinstance(dump.get("entries"), list):
        raise ConfigError(f"{path}: a flight recorder dump is a table with 'entries'")
    entries = [_collective(e) for e in dump["entries"] if isinstance(e, Mapping)]
    return RankTrace(rank, str(dump.get("version", "?")), entries)


def _collective(e: Mapping[str, Any]) -> Collective:
    group = e.get("process_group")
    name = group[0] if isinstance(group, list | tuple) and group else str(group or "")
    return Collective(
        seq=int(e.get("collective_seq_id", -1)),
        op=str(e.get("profiling_name", "?")),
        state=str(e.get("state", "?")),
        sizes=list(e.get("input_sizes", [])),
        group=str(name),
    )


def dump_files(path: Path) -> list[Path]:
    """The dump files at ``path``: a file, or every ``rank_N`` file of a directory."""
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and _RANK.search(p.name[::-1]))
        if files:
            return files
    raise ConfigError(
        f"no flight recorder dump at {path}",
        hint="a GPU job writes them on an NCCL timeout to <run_dir>/nccl_trace/rank_N",
    )


def _describe(c: Collective | None) -> str:
    if c is None:
        return "none"
    return f"#{c.seq} {c.op} sizes={c.sizes}"


def summarize(traces: list[RankTrace]) -> list[str]:
    """Per rank the last collective entered and completed; then which ranks lag and where.

    In a hang every rank waits in the same collective except the ones that never reached it:
    the ranks whose last entered sequence id is the lowest are the ones to look at.
    """
    lines = []
    for t in sorted(traces, key=lambda t: t.rank):
        last = t.last_entered
        state = f" ({last.state})" if last else ""
        lines.append(
            f"rank {t.rank}: entered {_describe(last)}{state}; "
            f"completed {_describe(t.last_completed)}"
        )
    reached = {t.rank: (t.last_entered.seq if t.last_entered else -1) for t in traces}
    if not reached:
        return lines
    front, back = max(reached.values()), min(reached.values())
    if front == back:
        stuck = [t for t in traces if t.last_entered and t.last_entered.state != "completed"]
        if stuck:
            c = stuck[0].last_entered
            lines.append(
                f"all ranks reached collective #{front} ({c.op if c else '?'}) and it did not "
                "complete: a network or NCCL problem, not a rank that fell behind "
                "(docs/troubleshooting.md)"
            )
        else:
            lines.append(f"all ranks completed collective #{front}: no collective was pending")
        return lines
    laggards = sorted(rank for rank, seq in reached.items() if seq == back)
    ahead = next(t.last_entered for t in traces if t.last_entered and t.last_entered.seq == front)
    lines.append(
        f"ranks {laggards} lag: last entered #{back}, the others wait in #{front} "
        f"({ahead.op if ahead else '?'}); look at what those ranks did instead (a data loader, "
        "a rank-dependent branch, a crash in their log)"
    )
    return lines


def run_step_line(dump_dir: Path) -> str | None:
    """Where training was: rank 0's progress.json, when the dumps sit in <run_dir>/nccl_trace."""
    progress = RunPaths(dump_dir.parent).progress if dump_dir.name == NCCL_TRACE else None
    if progress is None or not progress.is_file():
        return None
    try:
        info = json.loads(progress.read_text())
        step, epoch = int(info["step"]), int(info["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"training: rank 0 last reported global step {step} (epoch {epoch}) in {progress}"


def report(path: Path) -> list[str]:
    """``hpc-ddp doctor --nccl-dump PATH``: the dumps at ``path`` read and summarized."""
    files = dump_files(path)
    traces = [read_dump(f) for f in files]
    lines = [f"{len(traces)} flight recorder dump(s) in {path} (version {traces[0].version})"]
    lines += summarize(traces)
    step = run_step_line(path if path.is_dir() else path.parent)
    return lines + ([step] if step else [])
