"""The quick tier (``scripts/test.sh --quick``): the tests that each took under QUICK_S in the
recorded durations (tests/durations.json), never a Slurm or slow-marked one. A test with no
recorded duration (a new one) runs: it is quick until a full run records it otherwise. The
recorded durations also order the files of a parallel run, the longest first (conftest.py).

``scripts/test.sh --record-durations`` (a full run) writes that file again from its own reports:
setup, call and teardown of each test, as the process that reports sees them (pytest-xdist's
controller receives every worker's reports).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")
QUICK_S = 1.0


def recorded() -> dict[str, float]:
    try:
        return json.loads(DURATIONS.read_text())
    except FileNotFoundError:
        return {}


def select_quick(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect what is not quick, as pytest's own -m does (reported as deselected)."""
    took = recorded()
    slow_marks = ("slow", "slurm", "gpu")
    keep, drop = [], []
    for item in items:
        marked = any(item.get_closest_marker(m) for m in slow_marks)
        (drop if marked or took.get(item.nodeid, 0.0) >= QUICK_S else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# What a test without a recorded duration (a new one) is taken to last when ordering files.
UNRECORDED_S = {"slow": 30.0, "other": QUICK_S}


def file_seconds(items: list[pytest.Item]) -> dict[Path, float]:
    """Each test file's recorded seconds (all of its tests, setup and teardown included)."""
    took = recorded()
    seconds: dict[Path, float] = defaultdict(float)
    for item in items:
        guess = UNRECORDED_S["slow" if item.get_closest_marker("slow") else "other"]
        seconds[item.path] += took.get(item.nodeid, guess)
    return seconds


class Recorder:
    def __init__(self) -> None:
        self.took: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.took[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        rounded = {k: round(v, 3) for k, v in sorted(self.took.items())}
        DURATIONS.write_text(json.dumps(rounded, indent=0) + "\n")
