"""`hpc-ddp train` as one real process: results, run-dir rules, SIGTERM -> 75 -> resume."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from cli_forkserver import ForkedCli
from trainer_helpers import (
    finish,
    holding,
    interrupt_at,
    job_env,
    python_cmd,
    read_json,
    read_metrics,
    read_result,
    run,
    single_cmd,
    start,
    train_args,
    wait_for_progress,
)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """One uninterrupted single-process run of SMALL: checked by the first test, and the
    reference the interrupted run must end equal to (one process start instead of two)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    # As a rendered GPU job sets it: torch writes flight recorder dumps there on an NCCL
    # timeout but never makes the directory, so the trainer must (and only then).
    fr = {"TORCH_FR_DUMP_TEMP_FILE": f"{run_dir}/nccl_trace/rank_"}
    done = subprocess.run(
        single_cmd(train_args(run_dir, data_dir, plot=True)), env=job_env(**fr),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return run_dir


def test_single_process_writes_results(
    finished: Path, data_dir: Path, train_cli: ForkedCli
) -> None:
    run_dir = finished
    assert (run_dir / "nccl_trace").is_dir()
    result = read_result(run_dir)
    assert result["status"] == "finished" and result["world_size"] == 1
    assert (result["epochs"], result["steps"]) == (2, 2 * 16)  # 256 samples / 16
    assert result["test_samples"] == 101
    assert 0 < result["train_loss"] < 2.31 and result["test_accuracy"] > 0.3
    assert result["samples_per_second"] > 0
    # The training loop's wall time is part of the run's, which adds the start-up.
    assert 0 < result["train_wall_seconds"] < result["wall_seconds"]
    assert len(result["params_sha256"]) == 64
    rows = read_metrics(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert set(rows[0]["time"]) == {"data", "compute", "comm", "checkpoint", "eval"}
    assert rows[0]["time"]["checkpoint"] > 0 and rows[1]["train_loss"] < rows[0]["train_loss"]
    assert (run_dir / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert read_json(run_dir / "config.json")["batch_size"] == 16

    # A finished run dir is left alone: same settings -> "already finished", exit 0.
    again = train_cli.run(["train", *train_args(run_dir, data_dir)])
    assert again.returncode == 0 and "already finished" in again.stdout
    assert read_result(run_dir) == result
    # Different settings -> refused, naming what changed.
    other = train_cli.run(["train", *train_args(run_dir, data_dir, lr=0.1)])
    assert other.returncode == 2
    assert "different settings" in other.stderr and "lr: 0.001 -> 0.1" in other.stderr


@pytest.mark.slow
def test_sigterm_exits_75_and_resume_matches_uninterrupted(
    tmp_path: Path, data_dir: Path, finished: Path, train_cli: ForkedCli
) -> None:
    """SIGTERM at step 7 -> exit 75; the resumed run (loader workers, a checkpoint every 5
    steps) ends as the uninterrupted run without them did: neither changes a result."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir, checkpoint_every_steps=5)
    rc, log = interrupt_at(
        single_cmd([*args, "--debug-hold-at-step", "7"]),
        run_dir,
        tmp_path / "a.log",
        signal.SIGTERM,
    )
    assert rc == 75, log
    assert "preempted (SIGTERM)" in log and "not inside a Slurm job" in log
    assert not (run_dir / "result.json").exists()
    assert read_json(run_dir / "progress.json")["status"] == "preempted"
    checkpoints = run_dir / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip() / "shared.pt"
    first_attempt = torch.load(latest, weights_only=True)["progress"]
    assert 0 < first_attempt["train_wall_seconds"] < first_attempt["wall_seconds"]
    # Loader workers change nothing: augmentation is seeded per (seed, epoch, sample).
    resumed = train_cli.run(["train", *args, "--num-workers", "2"])
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "step 7" in resumed.stdout
    result = read_result(run_dir)
    assert result["params_sha256"] == read_result(finished)["params_sha256"]
    assert result["interruptions"] == 1 and result["steps"] == 32
    assert not (run_dir / "plot.png").exists()  # --no-plot (SMALL): no plot, nor its helper
    # The clocks go on from the checkpoint's (test_train_units has the exact sums).
    assert result["train_wall_seconds"] > first_attempt["train_wall_seconds"]
    assert result["wall_seconds"] > first_attempt["wall_seconds"]
    ref_rows, rows = read_metrics(finished), read_metrics(run_dir)
    assert [r["epoch"] for r in rows] == [1, 2]  # no duplicate rows from the first attempt
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in ref_rows]
    assert [r["test_accuracy"] for r in rows] == [r["test_accuracy"] for r in ref_rows]


def test_second_run_on_a_busy_run_dir_fails(
    tmp_path: Path, data_dir: Path, train_cli: ForkedCli
) -> None:
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir)
    first = start(single_cmd([*args, "--debug-hold-at-step", "3"]), tmp_path / "first.log")
    try:
        progress = wait_for_progress(run_dir, holding, first)
        second = train_cli.run(["train", *args])
        assert second.returncode == 2
        assert "is in use by pid" in second.stderr and str(progress["pids"][0]) in second.stderr
    finally:
        first.send_signal(signal.SIGUSR1)
        rc, log = finish(first, tmp_path / "first.log")
    assert rc == 75, log


def test_cli_rejects_bad_config(tmp_path: Path, data_dir: Path, train_cli: ForkedCli) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"epochs": 1, "momentun": 0.8}))
    done = train_cli.run(["train", "--config", str(cfg), "--run-dir", str(tmp_path / "r")])
    assert done.returncode == 2
    assert "unknown key 'momentun' (did you mean 'momentum'?)" in done.stderr
    assert "valid keys:" in done.stderr
    # A real dataset's missing data dir is a typo to report (a synthetic one is created).
    done = train_cli.run(
        ["train", *train_args(tmp_path / "r", tmp_path / "no-such-dir", synthetic=False)]
    )
    assert done.returncode == 2 and "data dir" in done.stderr and "does not exist" in done.stderr
    done = train_cli.run(["train", *train_args(tmp_path / "r", data_dir, amp="bf16")])
    assert done.returncode == 2 and "amp=bf16 needs a GPU" in done.stderr
    done = train_cli.run(["train", *train_args(tmp_path / "r", data_dir, sync_bn=True)])
    assert done.returncode == 2 and "sync_bn needs GPUs" in done.stderr


def test_run_process_returns_exit_codes_with_the_rank_named(tmp_path: Path, data_dir: Path) -> None:
    """The Python API: 0 for a finished run, 2 (error printed with its rank) for bad input."""
    code = (
        "import os, sys\n"
        "from hpc_ddp.train import TrainConfig, run_process\n"
        "kw = dict(synthetic_train_size=64, synthetic_test_size=16, epochs=1, batch_size=16,\n"
        "          model='lenet', log_every=100)\n"
        "ok = run_process(TrainConfig(synthetic=True, data_dir=sys.argv[1],\n"
        "                             run_dir=sys.argv[2], **kw))\n"
        "print('OK', ok, flush=True)\n"
        "os._exit(0)\n"  # a process group is left up on purpose: skip Gloo's exit-time teardown
    )
    good_script, bad_script = tmp_path / "good.py", tmp_path / "bad.py"
    good_script.write_text(code)
    bad_script.write_text(code.replace("synthetic=True", "synthetic=False"))
    # Forked from the tests' fork server (it imported torch): the interpreter is not tested.
    good = run(python_cmd(str(good_script), [str(data_dir), str(tmp_path / "run")]))
    assert "OK 0" in good.stdout, good.stdout + good.stderr
    bad = run(python_cmd(str(bad_script), [str(tmp_path / "missing"), str(tmp_path / "run2")]))
    assert "OK 2" in bad.stdout, bad.stdout + bad.stderr
    assert "[rank 0/1 " in bad.stderr and "does not exist" in bad.stderr, bad.stderr


def test_a_missing_synthetic_data_dir_is_created_and_said(
    tmp_path: Path, train_cli: ForkedCli
) -> None:
    """docs/training.md, Data staging: with --synthetic a missing --data-dir (parents included)
    is created, and the log says so; a real dataset's is an error (test_cli_rejects_bad_config)."""
    data_dir = tmp_path / "new" / "data"
    done = train_cli.run(["train", *train_args(tmp_path / "r", data_dir, epochs=1)], timeout=180)
    assert done.returncode == 0, done.stderr
    assert f"created data dir {data_dir} for the synthetic cifar10" in done.stdout, done.stdout
    assert (data_dir / ".hpc-ddp-staging.lock").exists()
