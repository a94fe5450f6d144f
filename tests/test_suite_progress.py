"""The suite's progress lines (conftest.Progress): tests done of all, failures, time so far, in a
serial run and under pytest-xdist, whose controller collects nothing itself. A pytest of its own
runs one short test file of this suite with a progress line after every test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^progress: (\d+)/(\d+) tests done \((\d+)%\), (\d+) failed, \d+m\d\ds so far$")


@pytest.mark.parametrize("workers", ["0", "1"], ids=["serial", "xdist"])
def test_a_line_says_tests_done_of_all_failures_and_time(workers: str) -> None:
    # Not a worker of this run's xdist, should it have one: the inner run is a run of its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", workers,
         "--progress-every", "0.000001", "tests/test_hostlist.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [m.groups() for m in map(LINE.match, proc.stdout.splitlines()) if m]
    total = int(lines[0][1])
    assert total > 10 and all(int(t) == total and f == "0" for _, t, _, f in lines), lines
    assert [int(done) for done, *_ in lines] == list(range(1, total + 1))  # one line each
    assert lines[-1][2] == "100"


class _Item:
    """What file_seconds reads of a pytest item."""

    def __init__(self, nodeid: str, slow: bool = False) -> None:
        self.nodeid, self.path, self.slow = nodeid, Path(nodeid.split("::")[0]), slow

    def get_closest_marker(self, name: str) -> object:
        return self.slow if name == "slow" else None


def test_files_are_ordered_by_their_recorded_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parallel run starts the files that took longest first (conftest.py): one long file
    with few slow-marked tests is not left for last. A test not yet recorded counts as slow-
    marked or quick by its mark."""
    import quick_tier

    took = {"a.py::many": 1.0, "a.py::more": 1.0, "b.py::long": 90.0}
    monkeypatch.setattr(quick_tier, "recorded", lambda: took)
    items = [_Item("a.py::many"), _Item("a.py::more"), _Item("a.py::new", slow=True)]
    items += [_Item("b.py::long"), _Item("c.py::new")]
    seconds = quick_tier.file_seconds(items)  # type: ignore[arg-type]
    assert seconds == {Path("a.py"): 32.0, Path("b.py"): 90.0, Path("c.py"): quick_tier.QUICK_S}
    items.sort(key=lambda item: -seconds[item.path])
    assert [i.nodeid for i in items] == [
        "b.py::long", "a.py::many", "a.py::more", "a.py::new", "c.py::new",
    ]  # fmt: skip
