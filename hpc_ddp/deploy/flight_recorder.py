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

Data never becomes code: a dump is read as plain data only (hpc_ddp.deploy.plain_pickle: no
global, so only dicts, lists, tuples, strings, numbers and None can come out; torch's own reader,
torch.distributed.flight_recorder, calls ``pickle.load``, which can run code), from a regular file
whose size is checked before it is read, and what it may build is bounded by its size (a few
bytes of pickle can ask for gigabytes). Reading it is bounded too: each rank's entries are walked
once, keeping per process group only the last collective entered and the last completed, and
values are shown cut short, without control characters, whatever their nesting. Torch-free.
"""

from __future__ import annotations

import itertools
import pickle
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpc_ddp import regular_file
from hpc_ddp.deploy import plain_pickle
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.paths import FR_DUMP_FILE_VAR, NCCL_TRACE, RunPaths

DUMP_PREFIX = "rank_"
# Entries kept per rank: enough to cover a few training steps of a DDP model (one all-reduce
# per gradient bucket), small enough to cost nothing (torch's own suggestion is 2000).
BUFFER_ENTRIES = 2000
# A dump of BUFFER_ENTRIES takes well under 1 MiB (torch memoizes repeated strings and frames).
MAX_DUMP_BYTES = 32 << 20
# Entries read from one dump: torch keeps TORCH_FR_BUFFER_SIZE (BUFFER_ENTRIES in rendered jobs).
MAX_ENTRIES = 100 * BUFFER_ENTRIES
# Process groups told apart in one dump: a job has a few, a model split many ways some hundreds.
MAX_GROUPS = 1024
# Frames looked through per entry for the program's own line: torch's own come first.
_MAX_FRAMES = 256
_SHOWN_ITEMS, _SHOWN_LEVELS = 8, 4  # of a container value: items per level, levels
_HINT = "pass the files TORCH_FR_DUMP_TEMP_FILE names (<run_dir>/nccl_trace/rank_N)"
_RANK = re.compile(r"(\d+)")
# A frame inside torch (distributed_c10d.py, autograd ...), not the program's own code.
_TORCH_FILE = re.compile(r"[/\\]torch[/\\]")


def flight_recorder_env(run_dir: str | None) -> dict[str, str]:
    """The variables a GPU job sets: buffer on, dump on timeout, dumps in the run directory
    (``<run_dir>/nccl_trace/rank_<N>``; relative to the job's working directory, like the run
    dir itself; None: the job's program has none known here, so the working directory). torch
    does not create the directory: the trainer's rank 0 does, at start."""
    base = NCCL_TRACE if run_dir is None else f"{run_dir.rstrip('/')}/{NCCL_TRACE}"
    return {
        "TORCH_FR_BUFFER_SIZE": str(BUFFER_ENTRIES),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        FR_DUMP_FILE_VAR: f"{base}/{DUMP_PREFIX}",
    }


def _text(value: Any, limit: int = 200) -> str:
    """A value of the dump as one printable line: its control characters (a terminal escape
    sequence in a hostile file) become '?', and it is cut at ``limit`` characters. Containers
    are shown a few items and levels deep, so a value nested or shared without end costs no
    more than a short one."""
    text = _shown(value, _SHOWN_LEVELS)[: limit + 1]
    text = "".join(ch if ch.isprintable() else "?" for ch in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shown(value: Any, levels: int) -> str:
    """``str(value)`` for scalars (a string cut short first), a bounded ``repr``-like text for
    containers: at most _SHOWN_ITEMS items per level, ``levels`` levels."""
    if isinstance(value, str):
        return value[:1000]
    if isinstance(value, list | tuple | Mapping):
        if levels == 0:
            return "..."
        items: Iterable[Any] = value.items() if isinstance(value, Mapping) else value
        head = list(itertools.islice(items, _SHOWN_ITEMS))
        if isinstance(value, Mapping):
            parts = [f"{_inner(k, levels)}: {_inner(v, levels)}" for k, v in head]
        else:
            parts = [_inner(v, levels) for v in head]
        if len(value) > _SHOWN_ITEMS:
            parts.append("...")
        left, right = (
            "{}" if isinstance(value, Mapping) else "()" if isinstance(value, tuple) else "[]"
        )
        return f"{left}{', '.join(parts)}{right}"
    return repr(value)[:1000]  # numbers (within 64 bits), bytes, None, booleans


def _inner(value: Any, levels: int) -> str:
    return repr(value[:1000]) if isinstance(value, str) else _shown(value, levels - 1)


@dataclass(frozen=True)
class Collective:
    seq: int
    op: str
    state: str
    completed: bool
    sizes: str  # input_sizes, as shown
    group: str
    call_site: str

    @property
    def status(self) -> str:
        """``completed`` once torch saw it finish, else the recorded state (``scheduled``,
        ``started``)."""
        return "completed" if self.completed else self.state


@dataclass(frozen=True)
class GroupTrace:
    """One rank's place in one process group: what a hang report compares."""

    last: Collective  # the last collective it entered
    done: Collective | None  # the last it completed


@dataclass(frozen=True)
class RankTrace:
    rank: int
    version: str
    comm_lib: str
    groups: dict[str, GroupTrace]  # by group label; empty: the rank recorded no collective


def read_dump(path: Path) -> RankTrace:
    """One rank's dump; ConfigError naming the file if it is not a flight recorder dump."""
    match = _RANK.search(path.name[::-1])
    if match is None:
        raise ConfigError(f"{path}: no rank number at the end of the file name", hint=_HINT)
    rank = int(match.group(1)[::-1])
    try:
        data = regular_file.read_small(path, MAX_DUMP_BYTES, follow_symlinks=True)
    except OSError as err:  # a FIFO, a device, a file larger than any dump: not read
        raise ConfigError(
            f"{path}: not a flight recorder dump: {err.strerror or err}", hint=_HINT
        ) from None
    try:
        dump = plain_pickle.loads(data)
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, IndexError) as err:
        raise ConfigError(
            f"{path}: not a readable flight recorder dump ({_text(str(err), 300)})", hint=_HINT
        ) from None
    if not isinstance(dump, Mapping) or not isinstance(dump.get("entries"), list):
        raise ConfigError(f"{path}: a flight recorder dump is a table with 'entries'", hint=_HINT)
    if len(dump["entries"]) > MAX_ENTRIES:
        raise ConfigError(
            f"{path}: {len(dump['entries'])} entries, more than the {MAX_ENTRIES} read from a "
            "dump (torch keeps TORCH_FR_BUFFER_SIZE of them)",
            hint=f"dump with a smaller TORCH_FR_BUFFER_SIZE ({BUFFER_ENTRIES} in rendered jobs)",
        )
    try:
        groups = _by_group(e for e in dump["entries"] if isinstance(e, Mapping))
    except ValueError as err:  # a sequence number that is no number, say
        raise ConfigError(f"{path}: a flight recorder entry is malformed ({err})") from None
    # Older dump formats (2.7) name the library version "nccl_version"; Gloo's is "" (no version).
    comm_lib = dump.get("comm_lib_version", dump.get("nccl_version", ""))
    return RankTrace(rank, _text(dump.get("version", "?")), _text(comm_lib or ""), groups)


def _by_group(entries: Iterable[Mapping[str, Any]]) -> dict[str, GroupTrace]:
    """Per process group, the last entry and the last completed one (torch lists entries
    oldest first). Only those two become Collectives: the rest are looked at and dropped."""
    last: dict[str, Mapping[str, Any]] = {}
    done: dict[str, Mapping[str, Any]] = {}
    for e in entries:
        group = _group_label(e)
        _seq(e)  # every entry's, not only the kept ones: a malformed one is said at once
        if group not in last and len(last) == MAX_GROUPS:
            raise ValueError(f"more than {MAX_GROUPS} process groups")
        last[group] = e
        if _completed(e):
            done[group] = e
    return {
        group: GroupTrace(
            _collective(e, group), _collective(done[group], group) if group in done else None
        )
        for group, e in last.items()
    }


def _seq(e: Mapping[str, Any]) -> int:
    seq = e.get("collective_seq_id", -1)
    if not isinstance(seq, int) or isinstance(seq, bool) or not -1 <= seq < 1 << 63:
        raise ValueError(f"collective_seq_id {_text(seq, 60)} is not a sequence number")
    return seq


def _completed(e: Mapping[str, Any]) -> bool:
    # Gloo never marks an entry started or completed (its state stays "scheduled"); torch sets
    # "retired" when a collective of either backend finished.
    return e.get("state") == "completed" or e.get("retired") is True


def _collective(e: Mapping[str, Any], group: str) -> Collective:
    return Collective(
        seq=_seq(e),
        op=_text(e.get("profiling_name", "?")),
        state=_text(e.get("state", "?")),
        completed=_completed(e),
        sizes=_text(e.get("input_sizes", [])),
        group=group,
        call_site=_call_site(e.get("frames")),
    )


def _group_label(e: Mapping[str, Any]) -> str:
    """``0 (default_pg)``: the process group's name and description (``process_group``), or
    its number (``pg_id``) in a dump without them."""
    group = e.get("process_group")
    if isinstance(group, list | tuple) and group:
        name, desc = _text(group[0]), (_text(group[1]) if len(group) > 1 else "")
        return _text(f"{name} ({desc})" if desc else name)
    return _text(e.get("pg_id", "?") if group is None else group)


def _call_site(frames: Any) -> str:
    """``train.py:120 in step``: the innermost frame outside torch's package, the line of the
    program that issued the collective (torch lists frames innermost first; NCCL's
    dump-on-timeout includes them, a dump without stack traces gives "")."""
    if not isinstance(frames, list):
        return ""
    for frame in itertools.islice(frames, _MAX_FRAMES):
        if not isinstance(frame, Mapping):
            continue
        filename = _text(frame.get("filename"), 500)
        if not _TORCH_FILE.search(filename):
            line, name = _text(frame.get("line", "?")), _text(frame.get("name", "?"))
            return _text(f"{filename}:{line} in {name}")
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
    return f"#{c.seq} {c.op} sizes={c.sizes}"


def _called_at(c: Collective) -> str:
    return f" called at {c.call_site}" if c.call_site else ""


def summarize(traces: list[RankTrace]) -> list[str]:
    """Per process group, per rank the last collective entered and completed; then which ranks
    lag and where. Sequence numbers count per process group, so groups are compared apart
    (a trainer's side group, like the checkpointer's Gloo group, has its own #1, #2 ...).
    A rank that recorded no collective at all (a crash or a hang before its first one) is named
    first: it is behind every other."""
    ranked = sorted(traces, key=_by_rank)
    silent = [t.rank for t in ranked if not t.groups]
    recording = [t for t in ranked if t.groups]
    lines = [f"rank {rank}: no collective recorded" for rank in silent]
    if not recording:
        return [
            *lines,
            "no rank recorded a collective: was TORCH_FR_BUFFER_SIZE 0, or did the hang come "
            "before the first collective?",
        ]
    if silent:
        lines.append(
            f"ranks {silent} recorded no collective while the others did: they never entered "
            "their first one; look at what those ranks did instead (a crash or a hang before "
            "it, in their log; TORCH_FR_BUFFER_SIZE=0 in their environment)"
        )
    groups = sorted({g for t in recording for g in t.groups}, key=_group_order)
    if len(groups) == 1:
        return lines + _summarize_group(recording, groups[0], bool(silent))
    for group in groups:
        lines.append(f"process group {group}:")
        members = [t for t in recording if group in t.groups]
        lines += [f"  {line}" for line in _summarize_group(members, group, bool(silent))]
    return lines


def _by_rank(t: RankTrace) -> int:
    return t.rank


def _group_order(group: str) -> tuple[int, str]:
    head = group.split(" ", 1)[0]
    return (int(head) if head.isdecimal() and len(head) < 19 else 1 << 62, group)


def _summarize_group(traces: list[RankTrace], group: str, some_silent: bool) -> list[str]:
    """In a hang every rank waits in the same collective except the ones that never reached
    it: the ranks whose last entered sequence number is the lowest are the ones to look at."""
    lines: list[str] = []
    reached: dict[int, Collective] = {}  # rank -> the last collective it entered
    for t in traces:
        place = t.groups[group]
        reached[t.rank] = place.last
        lines.append(
            f"rank {t.rank}: entered {_describe(place.last)} ({place.last.status}); "
            f"completed {_describe(place.done)}"
        )
    front = max(c.seq for c in reached.values())
    back = min(c.seq for c in reached.values())
    if front == back:
        stuck = [c for c in reached.values() if not c.completed]
        every = "every rank that recorded any" if some_silent else "all ranks"
        if stuck:
            cause = (
                ""
                if some_silent
                else ": a network or NCCL problem, not a rank that fell behind "
                "(docs/troubleshooting.md)"
            )
            lines.append(
                f"{every} reached collective #{front} ({stuck[0].op}{_called_at(stuck[0])}) "
                f"and it did not complete{cause}"
            )
        else:
            lines.append(f"{every} completed collective #{front}: no collective was pending")
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
