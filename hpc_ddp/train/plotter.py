"""plot.png, drawn by a helper process that loads matplotlib while the run trains.

matplotlib is slow to import and draw (benchmarks/NOTES.md). Drawn at the end of the run, rank 0
would spend that time after the work is done, on every command's way to its exit.
The helper starts when training does, imports matplotlib on another core at the lowest CPU
priority (a core it shares with training stays training's), then waits for the history on its
stdin (one line of JSON): at the end only the drawing is left, and it overlaps the teardown.

The helper is disposable. If it cannot start, dies (a signal meant for the job reaches it too),
or fails, rank 0 draws in its own process instead. It draws nothing when its stdin closes
empty (rank 0 died) and is ended at once when the run stops without finishing.

    python -m hpc_ddp.train.plotter RUN_DIR     # the helper; the history arrives as JSON on stdin
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.log import get_logger
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.train import results

log = get_logger("train")

SEND_TIMEOUT_S = 60.0  # to hand over a history longer than the pipe holds (helper importing)
DRAW_TIMEOUT_S = 60.0  # for the helper, after the history was sent; then rank 0 draws itself


class Plotter:
    """Rank 0's plot: made (the helper starts) while the run trains, ``draw`` once it finished,
    then ``finish`` after the teardown; ``cancel`` when it did not finish."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.history: list[dict[str, Any]] | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(run_dir)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except OSError as err:  # e.g. no process slot left: the plot is drawn here instead
            log.debug(f"plot helper not started ({err}); rank 0 draws the plot itself")

    def draw(self, history: list[dict[str, Any]]) -> None:
        """Hand the helper the history (it draws while the run tears down)."""
        self.history = history
        if self.proc is None or self.proc.stdin is None:
            return
        try:
            # One line (JSON escapes newlines): the helper reads to its end, not to EOF, which
            # never comes while a process forked from rank 0 after the helper started (a
            # DataLoader's persistent worker) holds a copy of the pipe's write end.
            sent = self._send(json.dumps(history).encode() + b"\n")
            self.proc.stdin.close()
        except OSError:  # the helper is gone (BrokenPipeError)
            sent = False
        if not sent:
            self.cancel()  # finish() draws here

    def _send(self, data: bytes) -> bool:
        """Write within SEND_TIMEOUT_S: a long history outgrows the pipe's buffer, and a helper
        that stopped reading must not hold rank 0."""
        assert self.proc is not None and self.proc.stdin is not None
        fd = self.proc.stdin.fileno()
        os.set_blocking(fd, False)
        deadline = time.monotonic() + SEND_TIMEOUT_S
        rest = memoryview(data)
        while rest:
            _, ready, _ = select.select([], [fd], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                return False
            rest = rest[os.write(fd, rest) :]
        return True

    def finish(self) -> None:
        """Wait for the plot; draw it in this process if the helper did not."""
        if self.history is None:
            self.cancel()
            return
        if self.proc is not None:
            if _exited_within(self.proc, DRAW_TIMEOUT_S):  # its stderr is a few lines at most
                self.proc.wait()
                err = self.proc.stderr.read() if self.proc.stderr else b""
            else:
                self.cancel()
                err = b"timed out"
            if self.proc is not None and self.proc.returncode == 0:
                self._close_pipes()
                return
            why = err.decode(errors="replace").strip().splitlines()[-1:] or ["no message"]
            log.debug(f"plot helper failed ({why[0]}); rank 0 draws the plot itself")
        try:
            results.plot(self.run_dir, self.history)
        except Exception as err:  # the plot is an extra: the run's results are written
            log.warning(f"could not draw {RunPaths(self.run_dir).plot}: {err}")

    def cancel(self) -> None:
        """End the helper now, drawing nothing: the run stopped without finishing (waiting for
        its import would delay a preempted run's exit), or the helper cannot be used."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self._close_pipes()
            self.proc = None

    def _close_pipes(self) -> None:
        assert self.proc is not None
        for pipe in (self.proc.stdin, self.proc.stderr):
            if pipe is not None and not pipe.closed:
                # OSError: stdin's unsent bytes to a dead helper, nothing worth keeping
                with contextlib.suppress(OSError):
                    pipe.close()


def _exited_within(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Whether ``proc`` ended within ``timeout`` s, told the moment it does: Popen.wait's
    timeout polls with growing sleeps, which would notice the exit late, on the command's way
    to its exit."""
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # no pidfd (Linux before 5.3, or the pid is gone): let Popen poll
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    return bool(ready)


def main(argv: list[str]) -> int:
    """The helper: import matplotlib, then draw the history that arrives on stdin (if any)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the trainer
    os.nice(19)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # the slow import, done before the history comes

    data = sys.stdin.buffer.readline()  # one line: see Plotter.draw
    if not data.strip():
        return 0
    results.plot(Path(argv[0]), json.loads(data))
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    sys.stderr.flush()
    # The plot is written: skip the interpreter's teardown of matplotlib, which rank 0 would
    # wait for. An exception above still exits through Python, its traceback printed.
    os._exit(code)
