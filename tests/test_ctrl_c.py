"""Ctrl-C on a real run: a real SIGINT to the process group (what a terminal sends) of a real
``hpc-ddp train``, alone and with ``--nproc-per-node 2`` (2 Gloo ranks; also with SIGTERM not a
requeue signal); progress.json then says ``interrupted`` and when, not ``training`` with dead
pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from trainer_helpers import finish, job_env, read_json, single_cmd, train_args, wait_for_progress


@pytest.mark.parametrize(
    ("nproc", "requeue_signals"),
    [(1, None), (2, None), (2, "USR1")],  # the last: SIGTERM would end a rank at once
)
def test_ctrl_c_leaves_progress_saying_interrupted(
    tmp_path: Path, data_dir: Path, nproc: int, requeue_signals: str | None
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "log"
    args = [*train_args(run_dir, data_dir, epochs=100), "--nproc-per-node", str(nproc)]
    if requeue_signals:
        args += ["--requeue-signal", requeue_signals]
    with log.open("w") as out:
        proc = subprocess.Popen(
            single_cmd(args), env=job_env(), stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, as a terminal's foreground job
        )  # fmt: skip
    try:
        wait_for_progress(run_dir, lambda p: p["status"] == "training" and p["step"] > 3, proc)
        before = datetime.now(timezone.utc).replace(microsecond=0)
        os.killpg(proc.pid, signal.SIGINT)
        rc, text = finish(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert rc == 130, text  # 128 + SIGINT, as a shell reports it
    progress = read_json(run_dir / "progress.json")
    interrupted = progress["status"] == "interrupted" and progress["reason"] == "SIGINT (Ctrl-C)"
    assert interrupted, (progress, text)
    assert progress["step"] > 3 and len(progress["pids"]) == nproc, progress
    if nproc > 1:  # the launcher let the others leave by themselves: no SIGTERM cut them short
        assert "got SIGINT too" in text and "stopping the other" not in text, text
    stopped = datetime.fromisoformat(progress["stopped_at"])
    assert before <= stopped <= datetime.now(timezone.utc), progress


LATE_CTRL_C = str(Path(__file__).parent / "workers" / "late_ctrl_c_train.py")


def test_ctrl_c_landing_while_another_error_is_handled_still_leaves_interrupted(
    tmp_path: Path, data_dir: Path
) -> None:
    """The order that made 2-rank Ctrl-C flaky: the step fails first (as a collective does when
    a peer leaves), then the rank's own SIGINT handler fires inside the trainer's recording of
    that failure (workers/late_ctrl_c_train.py makes the order certain). The record is not cut
    short: progress.json says interrupted, and the exit is Ctrl-C's."""
    run_dir = tmp_path / "run"
    args = [*train_args(run_dir, data_dir, epochs=2), "--debug-hold-at-step", "3"]
    done = subprocess.run(
        [sys.executable, LATE_CTRL_C, *args], env=job_env(), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 130, text
    assert "[rank 0/1" in text and "interrupted" in text, text
    progress = read_json(run_dir / "progress.json")
    assert progress["status"] == "interrupted" and progress["reason"] == "SIGINT (Ctrl-C)", progress
    assert progress["step"] == 3, progress
