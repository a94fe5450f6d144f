"""NCCL flight recorder: switched on in rendered GPU jobs, and its dumps read back.

PyTorch's ProcessGroupNCCL keeps a ring buffer of the last collectives of every rank (the
"flight recorder"). With ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` a rank whose collective times out
writes that buffer, and asks every other rank to write theirs, to
``<TORCH_FR_DUMP_TEMP_FILE><rank>``. (torch 2.14 reads ``TORCH_FR_BUFFER_SIZE`` and
``TORCH_FR_DUMP_TEMP_FILE``; ``TORCH_NCCL_TRACE_BUFFER_SIZE`` and
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` are their deprecated names.) A hang then leaves one file per
rank in the run directory instead of nothing.

A dump is a pickle of plain data: ``{"version": "2.10", "pg_config": {...}, "pg_status":
{...}, "comm_lib_version": "...", "entries": [...]}``, each entry a dict with ``record_id``,
``process_group`` (name, description), ``collective_seq_id`` (counted per process group),
``profiling_name`` (``nccl:all_reduce``, ``gloo:all_reduce``), ``state``, ``retired``,
``input_sizes``, ``frames`` (the Python stack that issued it, innermost first) and more (torch's
c10d FlightRecorder ``dump_entries``). NCCL's state moves scheduled -> started -> completed;
Gloo's stays "scheduled", and ``retired`` says a collective of either backend finished. Older
formats (2.7) name the library version ``nccl_version``. Missing keys read as unknown.

What is checked against torch's own output (tests/test_flight_recorder.py): torch 2.14 records
Gloo collectives too once ``TORCH_FR_BUFFER_SIZE`` is set, so real Gloo ranks hang for real and
write ``torch._C._distributed_c10d._dump_fr_trace`` bytes (the pickle dump-on-timeout writes;
Gloo itself never dumps on a timeout): the format, Gloo's states and ``retired``, several
process groups, ``frames``. Only NCCL on GPUs writes ``started``/``completed`` states and a
``comm_lib_version``: those are tested on dumps the test builds.

Data never becomes code: a dump is read with an unpickler that refuses every global, so only
dicts, lists, tuples, strings, numbers and None can come out (torch's own reader,
torch.distributed.flight_recorder, calls ``pickle.load``, which can run code), and its strings
are printed without control characters. Torch-free.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp import regular_file
from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.run_paths import FR_DUMP_FILE_VAR, NCCL_TRACE, RunPaths

DUMP_PREFIX = "rank_"
# Entries kept per rank: enough to cover a few training steps of a DDP model (one all-reduce
# per gradient bucket), small enough to cost nothing (torch's own suggestion is 2000).
BUFFER_ENTRIES = 2000
_MAX_DUMP_BYTES = 256 * 1024 * 1024
_RANK = re.compile(r"(\d+)")
# A frame inside torch (distributed_c10d.py, autograd ...), not the program's own code.
_TORCH_FILE = re.compile(r"[/\\]torch[/\\]")


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


def _text(value: Any, limit: int = 200) -> str:
    """A value of the dump as one printable line: its control characters (a terminal escape
    sequence in a hostile file) become '?', and it is cut at ``limit`` characters."""
    text = "".join(ch if ch.isprintable() else "?" for ch in str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Collective:
    seq: int
    op: str
    state: str
    completed: bool
    sizes: list[Any]
    group: str
    call_site: str

    @property
    def status(self) -> str:
        """``completed`` once torch saw it finish, else the recorded state (``scheduled``,
        ``started``)."""
        return "completed" if self.completed else self.state


@dataclass(frozen=True)
class RankTrace:
    rank: int
    version: str
    comm_lib: str
    entries: list[Collective]

    def in_group(self, group: str) -> list[Collective]:
        return [e for e in self.entries if e.group == group]


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
    try:
        entries = [_collective(e) for e in dump["entries"] if isinstance(e, Mapping)]
    except (TypeError, ValueError) as err:  # a sequence number that is no number, say
        raise ConfigError(f"{path}: a flight recorder entry is malformed ({err})") from None
    # Older dump formats (2.7) name the library version "nccl_version"; Gloo's is "" (no version).
    comm_lib = dump.get("comm_lib_version", dump.get("nccl_version", ""))
    return RankTrace(rank, _text(dump.get("version", "?")), _text(comm_lib or ""), entries)


def _collective(e: Mapping[str, Any]) -> Collective:
    state = _text(e.get("state", "?"))
    return Collective(
        seq=int(e.get("collective_seq_id", -1)),
        op=_text(e.get("profiling_name", "?")),
        state=state,
        # Gloo never marks an entry started or completed (its state stays "scheduled"); torch
        # sets "retired" when a collective of either backend finished.
        completed=state == "completed" or e.get("retired") is True,
        sizes=list(e.get("input_sizes", [])),
        group=_group_label(e),
        call_site=_call_site(e.get("frames")),
    )


def _group_label(e: Mapping[str, Any]) -> str:
    """``0 (default_pg)``: the process group's name and description (``process_group``), or
    its number (``pg_id``) in a dump without them."""
    group = e.get("process_group")
    if isinstance(group, list | tuple) and group:
        name, desc = group[0], (group[1] if len(group) > 1 else "")
        return _text(f"{name} ({desc})" if desc else name)
    return _text(e.get("pg_id", "?") if group is None else group)


def _call_site(frames: Any) -> str:
    """``train.py:120 in step``: the innermost frame outside torch's package, the line of the
    program that issued the collective (torch lists frames innermost first; NCCL's
    dump-on-timeout includes them, a dump without stack traces gives "")."""
    for frame in frames if isinstance(frames, list) else []:
        if isinstance(frame, Mapping) and not _TORCH_FILE.search(str(frame.get("filename"))):
            where = f"{frame.get('filename')}:{frame.get('line', '?')} in {frame.get('name', '?')}"
            return _text(where)
    return ""


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
    return f"#{c.seq} {c.op} sizes={_text(c.sizes)}"


def _called_at(c: Collective) -> str:
    return f" called at {c.call_site}" if c.call_site else ""


def summarize(traces: list[RankTrace]) -> list[str]:
    """Per process group, per rank the last collective entered and completed; then which ranks
    lag and where. Sequence numbers count per process group, so groups are compared apart
    (a trainer's side group, like the checkpointer's Gloo group, has its own #1, #2 ...)."""
    groups = sorted({e.group for t in traces for e in t.entries}, key=_group_order)
    if not groups:
        return [f"rank {t.rank}: no collective recorded" for t in sorted(traces, key=_by_rank)] + [
            "no rank recorded a collective: was TORCH_FR_BUFFER_SIZE 0, or did the hang come "
            "before the first collective?"
        ]
    if len(groups) == 1:
        return _summarize_group(traces, groups[0])
    lines = []
    for group in groups:
        lines.append(f"process group {group}:")
        members = [t for t in traces if t.in_group(group)]
        lines += [f"  {line}" for line in _summarize_group(members, group)]
    return lines


def _by_rank(t: RankTrace) -> int:
    return t.rank


def _group_order(group: str) -> tuple[int, str]:
    head = group.split(" ", 1)[0]
    return (int(head) if head.isdigit() else 1 << 62, group)


def _summarize_group(traces: list[RankTrace], group: str) -> list[str]:
    """In a hang every rank waits in the same collective except the ones that never reached
    it: the ranks whose last entered sequence number is the lowest are the ones to look at."""
    lines: list[str] = []
    reached: dict[int, Collective] = {}  # rank -> the last collective it entered
    for t in sorted(traces, key=_by_rank):
        entries = t.in_group(group)  # torch lists them oldest first
        done = [e for e in entries if e.completed]
        reached[t.rank] = last = entries[-1]
        lines.append(
            f"rank {t.rank}: entered {_describe(last)} ({last.status}); "
            f"completed {_describe(done[-1] if done else None)}"
        )
    front = max(c.seq for c in reached.values())
    back = min(c.seq for c in reached.values())
    if front == back:
        stuck = [c for c in reached.values() if not c.completed]
        if stuck:
            lines.append(
                f"all ranks reached collective #{front} ({stuck[0].op}{_called_at(stuck[0])}) "
                "and it did not complete: a network or NCCL problem, not a rank that fell behind "
                "(docs/troubleshooting.md)"
            )
        else:
            lines.append(f"all ranks completed collective #{front}: no collective was pending")
        return lines
    laggards = sorted(rank for rank, c in reached.items() if c.seq == back)
    ahead = next(c for c in reached.values() if c.seq == front)
    lines.append(
        f"ranks {laggards} lag: last entered #{back}, the others wait in #{front} "
        f"({ahead.op}{_called_at(ahead)}); look at what those ranks did instead (a data "
        "loader, a rank-dependent branch, a crash in their log)"
    )
    return lines


def run_step_line(dump_dir: Path) -> str | None:
    """Where training was: rank 0's progress.json, when the dumps sit in <run_dir>/nccl_trace."""
    progress = RunPaths(dump_dir.parent).progress if dump_dir.name == NCCL_TRACE else None
    if progress is None or not progress.is_file():
        return None
    try:
        info = regular_file.read_json(progress)
        step, epoch = int(info["step"]), int(info["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return f"training: rank 0 last reported global step {step} (epoch {epoch}) in {progress}"


def report(path: Path) -> list[str]:
    """``hpc-ddp doctor --nccl-dump PATH``: the dumps at ``path`` read and summarized."""
    files = dump_files(path)
    traces = [read_dump(f) for f in files]
    first = traces[0]
    lib = f", comm lib {first.comm_lib}" if first.comm_lib else ""
    lines = [f"{len(traces)} flight recorder dump(s) in {path} (version {first.version}{lib})"]
    lines += summarize(traces)
    step = run_step_line(path if path.is_dir() else path.parent)
    return lines + ([step] if step else [])
