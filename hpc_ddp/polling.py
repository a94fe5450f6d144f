"""Waiting for a condition with a deadline: the one polling loop of the package.

Whatever is awaited (a job's end, a daemon's pid file, a lock, a port that starts listening), the
wait asks a condition, sleeps, and asks again until the condition holds or the deadline passes.
``poll_until`` is that loop; ``wait_for`` is the same wait that raises at the deadline. The
condition may do the work of one poll (follow a log, note the state it saw for the message
of a timeout) and may raise to end the wait early.

Base layer: imports nothing of hpc_ddp's, never torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def poll_until(
    condition: Callable[[], T], timeout_s: float | None, interval_s: float = 0.1
) -> T | None:
    """The first truthy value of ``condition()``, asked every ``interval_s`` seconds; None once
    ``timeout_s`` seconds have passed without one (``timeout_s`` None: no deadline). The
    condition is asked at least once, and last at the deadline, after the last sleep."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if deadline is not None and time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


def wait_for(
    condition: Callable[[], T], timeout_s: float, what: str = "condition", interval_s: float = 0.1
) -> T:
    """``poll_until`` that raises TimeoutError naming ``what`` at the deadline."""
    value = poll_until(condition, timeout_s, interval_s)
    if value is None:
        raise TimeoutError(f"timed out after {timeout_s:.1f} s waiting for {what}")
    return value
