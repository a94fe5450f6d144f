"""Expand Slurm host lists and task counts, keeping Slurm's own order.

``scontrol show hostnames`` prints hosts in the order written, duplicates kept. Within one name
with several bracket groups Slurm's order is its own: the last group varies fastest, then the
first, the second, ..., the second-to-last slowest (``a[1-2]b[3-4]c[5-6]`` starts a1b3c5,
a1b3c6, a2b3c5). Slurm strips the last group of the prefix and recurses on the rest, so the
groups before the last nest right to left. ClusterShell's NodeSet sorts and de-duplicates (which
can change the first host, i.e. MASTER_ADDR) and python-hostlist is GPL, hence this small
parser. It accepts a superset of what Slurm 22.05 prints: text after the last bracket
(``node[1-2]-ib``) is allowed, as newer Slurm and ClusterShell allow it.

Sizes are counted from the ranges before anything is expanded, and the whole list is capped:
``n[0-99999][0-99999][0-99999]`` is refused at once instead of filling memory.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass

from hpc_ddp.cluster.host_names import is_host_name, is_name_text
from hpc_ddp.errors import LaunchEnvError

# A Slurm job spans at most 64 Ki nodes (MAX_SLURM_NODES in slurm.h), so a longer list is a
# typo or an attack; it is refused before a single name is built.
MAX_HOSTS = 65536
_RANGE = re.compile(r"([0-9]{1,18})(?:-([0-9]{1,18}))?")
_TASKS = re.compile(r"([0-9]{1,9})(?:\(x([0-9]{1,9})\))?")
# Separators outside brackets: commas, and the whitespace `scontrol show hostnames` prints.
_SEPARATORS = frozenset(", \t\n\r\v\f")


def _bad(text: str, why: str) -> LaunchEnvError:
    return LaunchEnvError(
        f"cannot parse host list {text!r}: {why}",
        hint="expected Slurm's form, e.g. 'gpu-a[001-004,010],login1'; "
        "check SLURM_STEP_NODELIST / SLURM_JOB_NODELIST or the -w list you passed",
    )


@dataclass(frozen=True)
class _Range:
    lo: int
    hi: int
    width: int  # zero padding, from the lower bound as in Slurm: a[01-3] -> a01..a03

    def names(self) -> Iterator[str]:
        return (str(n).zfill(self.width) for n in range(self.lo, self.hi + 1))


@dataclass(frozen=True)
class _Name:
    """One comma-separated part: texts[0] group[0] texts[1] ... group[n-1] texts[n]."""

    texts: tuple[str, ...]
    groups: tuple[tuple[_Range, ...], ...]

    def count(self, cap: int) -> int:
        """Hosts this part names, or cap + 1 once the product passes cap (never a huge int)."""
        total = 1
        for group in self.groups:
            total *= sum(r.hi - r.lo + 1 for r in group)
            if total > cap:
                return cap + 1
        return total

    def expand(self) -> Iterator[str]:
        n = len(self.groups)
        # Slowest first: groups n-2 .. 0, then the last one (see the module docstring).
        order = [*range(n - 2, -1, -1), n - 1] if n > 1 else list(range(n))
        values = [[v for r in self.groups[g] for v in r.names()] for g in order]
        for combo in itertools.product(*values):
            by_group = dict(zip(order, combo, strict=True))
            parts = [self.texts[0]]
            for g in range(n):
                parts += [by_group[g], self.texts[g + 1]]
            yield "".join(parts)


def _split_top_level(text: str) -> list[str]:
    """Split on commas and whitespace that are outside brackets."""
    parts: list[str] = []
    depth, start = 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            if depth:
                raise _bad(text, "nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise _bad(text, "']' without '['")
            depth = 0
        elif ch in _SEPARATORS and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(text, "'[' without ']'")
    parts.append(text[start:])
    return [p for p in parts if p]


def _parse_group(body: str, text: str) -> tuple[_Range, ...]:
    ranges = []
    for item in body.split(","):
        match = _RANGE.fullmatch(item)
        if not match:
            raise _bad(text, f"invalid range {item!r} in '[{body}]' (ASCII digits, 'a-b')")
        lo_text, hi_text = match.group(1), match.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise _bad(text, f"range {item!r} goes backwards")
        ranges.append(_Range(lo, hi, len(lo_text)))
    return tuple(ranges)


def _parse_name(part: str, text: str) -> _Name:
    pieces = re.split(r"\[([^\]]*)\]", part)  # texts at even indices, group bodies at odd
    texts = tuple(pieces[0::2])
    for literal in texts:
        if not is_name_text(literal):
            raise _bad(text, f"{literal!r} is not a host name (letters, digits, '.', '-', '_')")
    return _Name(texts, tuple(_parse_group(body, text) for body in pieces[1::2]))


def _parse(text: str) -> list[_Name]:
    stripped = text.strip()
    if not stripped or stripped == "(null)":
        raise _bad(text, "empty")
    return [_parse_name(part, text) for part in _split_top_level(stripped)]


def expand_hostlist(text: str) -> list[str]:
    """``"gpu[01-02],login1"`` -> ``["gpu01", "gpu02", "login1"]``, in Slurm's order."""
    names = _parse(text)
    # Counted first: a product of ranges is never built just to be refused.
    if sum(name.count(MAX_HOSTS) for name in names) > MAX_HOSTS:
        raise _bad(text, f"more than {MAX_HOSTS} hosts (the most a Slurm job can have)")
    hosts = [host for name in names for host in name.expand()]
    # Each part was host-name text; a whole name must also start well and fit DNS's length.
    bad = next((host for host in hosts if not is_host_name(host)), None)
    if bad is not None:
        raise _bad(
            text,
            f"{bad!r} is not a host name (one starts with a letter, a digit or '_' and has at "
            "most 253 characters)",
        )
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed counts, ``"2(x3),1"`` -> ``[2, 2, 2, 1]`` (one entry per node)."""
    items: list[tuple[int, int]] = []
    for item in text.strip().split(","):
        match = _TASKS.fullmatch(item.strip())
        if not match:
            raise LaunchEnvError(
                f"cannot parse tasks-per-node value {text!r} (bad item {item!r})",
                hint="expected Slurm's form such as '2(x3),1'; "
                "check SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE",
            )
        repeat = int(match.group(2) or 1)
        if repeat < 1:
            raise LaunchEnvError(
                f"tasks-per-node value {text!r} repeats {item!r} zero times",
                hint="expected Slurm's form such as '2(x3),1'",
            )
        items.append((int(match.group(1)), repeat))
    nodes = sum(repeat for _, repeat in items)
    if nodes > MAX_HOSTS:  # one entry per node: counted before the list is built
        raise LaunchEnvError(
            f"tasks-per-node value {text!r} describes {nodes} nodes, more than {MAX_HOSTS} "
            "(the most a Slurm job can have)",
            hint="check SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE: Slurm never writes "
            "this; look for a value exported by hand",
        )
    return [count for count, repeat in items for _ in range(repeat)]
