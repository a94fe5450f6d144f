"""The one polling loop (hpc_ddp/polling.py): what it returns, when it gives up, what it says.
In-process, real clock, waits of a fraction of a second."""

from __future__ import annotations

import time

import pytest

from hpc_ddp.polling import poll_until, wait_for


def test_the_first_truthy_answer_is_returned() -> None:
    answers = iter([0, "", None, [], "ready", "later"])
    assert poll_until(lambda: next(answers), 10, interval_s=0.001) == "ready"
    assert next(answers) == "later"  # asked no more once it held


def test_none_at_the_deadline_with_a_last_answer_taken_there() -> None:
    asked: list[float] = []
    start = time.monotonic()
    assert poll_until(lambda: asked.append(time.monotonic()), 0.2, interval_s=0.05) is None
    assert asked[-1] - start >= 0.2 - 0.01 and len(asked) >= 3
    once: list[int] = []
    assert poll_until(lambda: once.append(1), 0) is None and once == [1]  # asked at least once


def test_no_deadline_waits_until_it_holds_and_an_error_ends_the_wait() -> None:
    count = iter(range(100))
    assert poll_until(lambda: next(count) == 30, None, interval_s=0.001)

    def broken() -> bool:
        raise RuntimeError("the daemon died")

    with pytest.raises(RuntimeError, match="the daemon died"):
        poll_until(broken, 10)


def test_wait_for_raises_naming_what_it_waited_for() -> None:
    assert wait_for(lambda: 7, 1, "seven") == 7
    with pytest.raises(TimeoutError, match=r"^timed out after 0\.1 s waiting for the job$"):
        wait_for(lambda: False, 0.1, "the job", interval_s=0.02)
