"""Expand Slurm host lists and task counts, keeping Slurm's own order.

``scontrol show hostnames`` prints hosts in the order written, cartesian products left to right,
duplicates kept. ClusterShell's NodeSet sorts and de-duplicates (which can change the first host,
i.e. MASTER_ADDR) and python-hostlist is GPL, hence this small parser. It accepts a superset of
what Slurm 22.05 prints: text after the last bracket (``node[1-2]-ib``) is allowed, as newer
Slurm and ClusterShell allow it.
"""

from __future__ import annotations

import re

from hpc_ddp.errors import LaunchEnvError

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
# Guards against a typo like n[1-99999999] eating memory before the count check catches it.
_MAX_HOSTS = 1_000_000


def _bad(text: str, why: str) -> LaunchEnvError:
    return LaunchEnvError(
        f"cannot parse host list {text!r}: {why}",
        hint="expected Slurm's form, e.g. 'gpu-a[001-004,010],login1'; "
        "check SLURM_STEP_NODELIST / SLURM_JOB_NODELIST or the -w list you passed",
    )


def _split_top_level(text: str) -> list[str]:
    """Split on commas and spaces that are outside brackets."""
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
        elif ch in ", " and not depth:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise _bad(text, "'[' without ']'")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_ranges(body: str, text: str) -> list[str]:
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE.match(item)
        if not match:
            raise _bad(text, f"invalid range {item!r} in '[{body}]'")
        lo_text, hi_text = match.group(1), match.group(2)
        lo, hi = int(lo_text), int(hi_text if hi_text is not None else lo_text)
        if hi < lo:
            raise _bad(text, f"range {item!r} goes backwards")
        if len(values) + hi - lo + 1 > _MAX_HOSTS:
            raise _bad(text, f"more than {_MAX_HOSTS} hosts")
        # Padding follows the lower bound, as in Slurm: a[01-3] -> a01..a03, a[1-03] -> a1..a3.
        width = len(lo_text)
        values.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return values


def _expand_one(pattern: str, text: str) -> list[str]:
    hosts = [""]
    for piece in re.split(r"(\[[^\]]*\])", pattern):
        if piece.startswith("["):
            options = _expand_ranges(piece[1:-1], text)
            hosts = [h + o for h in hosts for o in options]
            if len(hosts) > _MAX_HOSTS:
                raise _bad(text, f"more than {_MAX_HOSTS} hosts")
        elif piece:
            hosts = [h + piece for h in hosts]
    return hosts


def expand_hostlist(text: str) -> list[str]:
    """``"gpu[01-02],login1"`` -> ``["gpu01", "gpu02", "login1"]``, in Slurm's order."""
    text = text.strip()
    if not text or text == "(null)":
        raise _bad(text, "empty")
    hosts: list[str] = []
    for part in _split_top_level(text):
        hosts.extend(_expand_one(part, text))
    return hosts


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's compressed counts, ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in text.strip().split(","):
        match = _TASKS.match(item.strip())
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
        counts.extend([int(match.group(1))] * repeat)
    return counts
