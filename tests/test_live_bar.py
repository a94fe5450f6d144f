"""Rank 0's live progress bar, on a real pseudo-terminal (pty.openpty) and through a real pipe:
a real ``hpc-ddp train`` run each time (forked from the tests' fork server, its stdout and stderr
opened on the terminal), so the TTY test is the one the process itself makes."""

from __future__ import annotations

import os
import pty
import re
import select
from pathlib import Path

import pytest
from trainer_helpers import fork_server, job_env, run, single_cmd, train_args

# The bar: "\r" then "epoch 1/1 [####....] step N/16"; a plain line never holds "[#" or "[.".
BAR = re.compile(r"\repoch 1/1 \[[#.]{24}\] step (\d+)/16")
PLAIN = "epoch 1: train loss"  # the plain line that ends the epoch, on every output


def _on_a_terminal(args: list[str], **env: str) -> str:
    """`hpc-ddp train args` with stdout and stderr on the slave side of a new pty; return all
    it wrote. The slave stays open here until the run has ended (it opens the terminal by name
    after this call returns), so the master is read until then and drained after."""
    master, slave = pty.openpty()
    proc = fork_server().start(["train", *args], Path(os.ttyname(slave)), env=job_env(**env))
    chunks = []
    try:
        while True:
            ended = proc.poll() is not None  # before the read: all it wrote is there by then
            while select.select([master], [], [], 0 if ended else 0.2)[0]:
                chunks.append(os.read(master, 65536))
            if ended:
                break
    finally:
        os.close(slave)
        os.close(master)
    assert proc.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    return b"".join(chunks).decode()


def test_a_terminal_shows_the_live_bar_and_the_plain_lines(tmp_path: Path, data_dir: Path) -> None:
    out = _on_a_terminal(train_args(tmp_path / "run", data_dir, epochs=1))
    steps = [int(m.group(1)) for m in BAR.finditer(out)]
    assert steps and steps[-1] == 16 and steps == sorted(steps), out  # redrawn up to the end
    assert PLAIN in out, out
    assert re.search(r"\repoch 1/1 \[#{24}\] step 16/16 \d+ samples/s", out), out  # the rate
    assert "epoch 1/1 step 16/16 loss" in out, out  # the plain line of log_every, kept


@pytest.mark.parametrize("env", [{"NO_COLOR": "1"}, {"TERM": "dumb"}])
def test_a_terminal_that_asks_for_plain_output_gets_no_bar(
    tmp_path: Path, data_dir: Path, env: dict[str, str]
) -> None:
    out = _on_a_terminal(train_args(tmp_path / "run", data_dir, epochs=1), **env)
    assert PLAIN in out and "[#" not in out and "[." not in out, out


def test_a_pipe_gets_plain_lines_only(tmp_path: Path, data_dir: Path) -> None:
    done = run(single_cmd(train_args(tmp_path / "run", data_dir, epochs=1)))
    assert done.returncode == 0, done.stderr
    assert PLAIN in done.stdout and "\r" not in done.stdout and "[#" not in done.stdout, done.stdout
