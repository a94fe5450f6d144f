"""A run dir that is not ours: refused untouched; inside ours, only our own leftovers go.

Real CLI runs of the trainer (one process, tiny synthetic data: trainer_helpers.SMALL), real
files, real ownership (chown to ``nobody``; the machine runs as root) and real links.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from cli_forkserver import ForkedCli
from hostile_files import snapshot
from trainer_helpers import (
    finish,
    holding,
    read_json,
    signal_workers,
    single_cmd,
    start,
    train_args,
    wait_for_progress,
)

from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.marker import FORMAT, MARKER, claim_run_dir

NOBODY = 65534


def test_a_directory_of_other_files_is_refused_untouched(
    tmp_path: Path, data_dir: Path, train_cli: ForkedCli
) -> None:
    """``hpc-ddp train --run-dir DIR`` on a directory of someone's files, some named as the
    trainer's own: exit 2 with a HINT, and not one byte, mtime or entry changed."""
    run_dir = tmp_path / "project"
    (run_dir / "checkpoints" / ".tmp-mine").mkdir(parents=True)
    (run_dir / "checkpoints" / ".tmp-mine" / "data.bin").write_bytes(b"\x00" * 64)
    (run_dir / "notes.txt").write_text("my notes\n")
    (run_dir / "config.json").write_text(json.dumps({"theme": "dark"}))
    (run_dir / "metrics.jsonl").write_text('{"mine": 1}\n')
    (run_dir / "progress.json").write_text('{"mine": true}\n')
    (run_dir / "plot.png").write_bytes(b"not the trainer's plot")
    before = snapshot(run_dir)
    done = train_cli.run(["train", *train_args(run_dir, data_dir)])
    assert done.returncode == 2, done.stderr
    assert f"run dir {run_dir} is not empty and is not an hpc-ddp run dir" in done.stderr
    assert "notes.txt" in done.stderr
    assert "notes.txt, plot.png and 1 more" in done.stderr  # 6 entries, the first 5 named
    assert "HINT: choose an empty or new --run-dir" in done.stderr
    assert snapshot(run_dir) == before


def test_a_run_dir_is_marked_and_one_without_its_marker_refused(
    tmp_path: Path, data_dir: Path, train_cli: ForkedCli
) -> None:
    """The trainer marks the run dir it creates; the same files without the marker are not a
    run dir of the trainer's (its config.json included): refused untouched."""
    run_dir = tmp_path / "run"
    done = train_cli.run(["train", *train_args(run_dir, data_dir, epochs=1)])
    assert done.returncode == 0, done.stderr
    assert read_json(run_dir / MARKER)["format"] == FORMAT
    (run_dir / MARKER).unlink()
    (run_dir / "result.json").unlink()  # else the finished run's answer comes first
    before = snapshot(run_dir)
    again = train_cli.run(["train", *train_args(run_dir, data_dir, epochs=1)])
    assert again.returncode == 2, again.stderr
    assert f"run dir {run_dir} is not empty and is not an hpc-ddp run dir" in again.stderr
    assert snapshot(run_dir) == before


def test_the_slurm_jobs_own_log_does_not_make_a_dir_foreign(tmp_path: Path) -> None:
    """Job specs put Slurm's --output (named with %j) into the run dir, and Slurm creates it
    before the trainer starts: that file alone is not someone else's content."""
    for job_id, log, accepted in (
        ("1234", "train-1234.out", True),
        ("1234", "train-1234.out.rank0", True),
        ("99", "train-1234.out", False),  # another job's log
        ("1234", "train-12345.out", False),  # the id must stand alone
    ):
        run_dir = tmp_path / f"{job_id}-{log}"
        run_dir.mkdir()
        (run_dir / log).write_text("slurm log\n")
        env = {"SLURM_JOB_ID": job_id}
        if accepted:
            claim_run_dir(run_dir, env)
            assert read_json(run_dir / MARKER)["format"] == FORMAT
        else:
            with pytest.raises(ConfigError, match="not an hpc-ddp run dir"):
                claim_run_dir(run_dir, env)
            assert sorted(p.name for p in run_dir.iterdir()) == [log]


def test_only_the_locks_own_leftovers_pass_for_the_toolkits(tmp_path: Path) -> None:
    """A lock file and owner file as RunDirLock leaves them do not make a dir foreign; files of
    someone else's by those names do, and are left as they were."""
    owner = {"pid": 1, "host": "n1", "since": "2026-11-27T00:00:00Z", "argv": [], "job_id": None}
    for name, text, accepted in (
        (".run.lock", "", True),
        (".run.lock.owner", json.dumps(owner), True),
        (".run.lock", "mine", False),
        (".run.lock.owner", '{"mine": 1}', False),
    ):
        run_dir = tmp_path / f"{name}-{accepted}-{len(text)}"
        run_dir.mkdir()
        (run_dir / name).write_text(text)
        if accepted:
            claim_run_dir(run_dir, {})
            assert read_json(run_dir / MARKER)["format"] == FORMAT
        else:
            with pytest.raises(ConfigError, match=f"it holds {name}"):
                claim_run_dir(run_dir, {})
            assert [(p.name, p.read_text()) for p in run_dir.iterdir()] == [(name, text)]


def test_a_marker_that_is_not_ours_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"format": FORMAT}))
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / MARKER).symlink_to(elsewhere)
    forged = tmp_path / "forged"
    forged.mkdir()
    (forged / MARKER).write_text("yes, trust me\n")
    for run_dir in (linked, forged):
        with pytest.raises(ConfigError, match="not a run dir marker written by hpc-ddp"):
            claim_run_dir(run_dir, {})


def test_only_our_own_checkpoint_leftovers_are_removed(tmp_path: Path, data_dir: Path) -> None:
    """A real run saves a checkpoint (preempted by SIGTERM) while checkpoints/ holds a leftover
    of ours, a user's ``.tmp-*`` directory, another user's directory named as ours, and a link
    named as ours: only our own leftover is removed."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir, checkpoint_every_steps=100)
    ckpts = run_dir / "checkpoints"
    ours = ckpts / ".tmp-step-00000002"
    users = ckpts / ".tmp-mine"
    others = ckpts / ".trash-step-00000001-42"
    target = tmp_path / "linked-target"
    linked = ckpts / ".tmp-step-00000001"

    log_path = tmp_path / "a.log"
    proc = start(single_cmd([*args, "--debug-hold-at-step", "3"]), log_path)
    try:
        progress = wait_for_progress(run_dir, holding, proc)  # checkpoints/ exists by now
        for path in (ours, users, others, target):
            path.mkdir()
            (path / "f").write_text(path.name)
        os.chown(others, NOBODY, NOBODY)
        linked.symlink_to(target)
        signal_workers(progress, signal.SIGTERM)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    rc, log = finish(proc, log_path)
    assert rc == 75, log
    assert not ours.exists() and "removing .tmp-step-00000002" in log
    for path in (users, others, target):
        assert (path / "f").read_text() == path.name, path
    assert linked.is_symlink()
