"""plot.png's helper process (hpc_ddp.train.plotter): it draws what rank 0 hands it, rank 0 draws
itself when the helper is gone, and a run that does not finish leaves neither plot nor helper."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp.train import plotter, results
from hpc_ddp.train.plotter import Plotter

PNG = b"\x89PNG\r\n\x1a\n"
HISTORY = [
    {"epoch": e, "train_loss": 2.0 / e, "test_loss": 2.1 / e, "test_accuracy": 0.2 * e}
    for e in (1, 2, 3)
]
DEADLINE_S = 60


def test_the_helper_draws_the_history_it_is_handed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def not_here(*_: object) -> None:
        raise AssertionError("rank 0 drew the plot itself: the helper should have")

    monkeypatch.setattr(results, "plot", not_here)  # this process only: the helper is another
    plot = Plotter(tmp_path)
    assert plot.proc is not None
    plot.draw(HISTORY)
    plot.finish()
    assert plot.proc.returncode == 0
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG


def test_the_helper_draws_while_a_process_forked_from_rank0_lives(tmp_path: Path) -> None:
    """A DataLoader's persistent workers are forked from rank 0 after the helper started, so
    they hold the write end of its stdin until rank 0 exits: the history must arrive whole
    without waiting for the pipe to close."""
    plot = Plotter(tmp_path)
    assert plot.proc is not None
    child = os.fork()
    if child == 0:  # the forked worker: holds every descriptor rank 0 had, until killed
        signal.pthread_sigmask(signal.SIG_BLOCK, [])
        while True:
            signal.pause()
    try:
        plot.draw(HISTORY)
        assert plotter._exited_within(plot.proc, DEADLINE_S), "the helper waited for EOF"
        plot.finish()
        assert plot.proc.returncode == 0
        assert (tmp_path / "plot.png").read_bytes()[:8] == PNG
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_rank0_draws_when_the_helper_is_gone(tmp_path: Path) -> None:
    plot = Plotter(tmp_path)
    assert plot.proc is not None
    plot.proc.kill()  # as a signal meant for the job would
    plot.proc.wait(timeout=DEADLINE_S)
    plot.draw(HISTORY)  # a broken pipe: nothing to raise
    plot.finish()
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG


def test_a_run_that_stops_unfinished_ends_the_helper_without_a_plot(tmp_path: Path) -> None:
    plot = Plotter(tmp_path)
    proc = plot.proc
    assert proc is not None
    plot.finish()  # no history: the run was preempted or failed
    assert plot.proc is None and proc.returncode is not None  # reaped, not left behind
    assert not (tmp_path / "plot.png").exists()


def test_the_helper_leaves_when_rank0_dies_before_the_end(tmp_path: Path) -> None:
    """Its stdin closes empty when rank 0's process is gone: it exits, drawing nothing."""
    helper = subprocess.Popen(
        [sys.executable, "-m", plotter.__name__, str(tmp_path)],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    _, err = helper.communicate(b"", timeout=DEADLINE_S)
    assert helper.returncode == 0, err
    assert not (tmp_path / "plot.png").exists()


def test_the_helper_never_writes_through_a_link(tmp_path: Path) -> None:
    """plot.png goes through private_paths.replace_file in the helper too: a link planted at
    the path is replaced by the new file, never followed to what it names."""
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "plot.png").symlink_to(victim)
    plot = Plotter(tmp_path)
    plot.draw(HISTORY)
    plot.finish()
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "plot.png").is_symlink()
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG


def test_a_long_history_outgrows_the_pipe_and_still_arrives(tmp_path: Path) -> None:
    """Far more than a pipe's 64 KiB: handed over while the helper reads, not dropped."""
    long = [{**HISTORY[0], "epoch": e, "note": "x" * 300} for e in range(1, 401)]  # ~140 KB
    plot = Plotter(tmp_path)
    plot.draw(long)
    assert plot.proc is not None  # sent in full: the helper draws, rank 0 does not
    plot.finish()
    assert plot.proc.returncode == 0
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize(
    ("timeout", "history", "stop_first"),
    [
        ("SEND_TIMEOUT_S", [{**HISTORY[0], "note": "x" * 300} for _ in range(400)], True),
        ("DRAW_TIMEOUT_S", HISTORY, False),  # a short history: all of it sits in the pipe
    ],
    ids=["stops-reading", "never-finishes-drawing"],
)
def test_a_stuck_helper_does_not_hold_rank0(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    timeout: str,
    history: list[dict[str, float]],
    stop_first: bool,
) -> None:
    """A helper alive but doing nothing (stopped) is given up on after SEND_TIMEOUT_S while a
    history longer than the pipe is handed over, or after DRAW_TIMEOUT_S while rank 0 waits
    for the drawing; it is ended, and rank 0 draws instead."""
    monkeypatch.setattr(plotter, timeout, 1.0)
    plot = Plotter(tmp_path)
    helper = plot.proc
    assert helper is not None
    if stop_first:
        os.kill(helper.pid, signal.SIGSTOP)
    plot.draw(history)
    if stop_first:
        assert plot.proc is None  # given up on at once (SIGKILL ends a stopped process too)
    else:
        os.kill(helper.pid, signal.SIGSTOP)
    plot.finish()
    assert plot.proc is None and helper.returncode == -signal.SIGKILL
    assert (tmp_path / "plot.png").read_bytes()[:8] == PNG
