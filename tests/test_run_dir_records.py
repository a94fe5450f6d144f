"""The run dir's JSON records (config.json, progress.json, result.json, the lock's owner) under
hostile files: a FIFO planted at one of those names blocks a plain ``open()`` until a writer
comes, so every reader goes through ``regular_file`` and ends at once with a clear outcome.

Real FIFOs (mkfifo), the real ``hpc-ddp`` command, a real finished CPU run; each command runs
with a deadline, which a blocked read would overrun (``subprocess.TimeoutExpired`` fails the
test instead of hanging it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cli_forkserver import ForkedCli
from hostile_files import make_fifo
from trainer_helpers import HPC_DDP, run, train_args

from hpc_ddp import regular_file

DEADLINE_S = 60  # a CPU run of SMALL takes seconds; a blocked read never ends


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, train_cli: ForkedCli) -> tuple[Path, Path]:
    """(run dir, data dir) of one finished single-process run."""
    root = tmp_path_factory.mktemp("records")
    run_dir, data_dir = root / "run", root / "data"
    done = train_cli.run(["train", *train_args(run_dir, data_dir, epochs=1)])
    assert done.returncode == 0, done.stderr
    return run_dir, data_dir


def test_a_fifo_as_result_json_of_a_new_run_dir_is_refused_at_once(
    tmp_path: Path, train_cli: ForkedCli
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    make_fifo(run_dir / "result.json")
    done = train_cli.run(["train", *train_args(run_dir, tmp_path / "data")], timeout=DEADLINE_S)
    assert done.returncode == 2, done.stderr
    assert "is not an hpc-ddp run dir" in done.stderr and "result.json" in done.stderr


def test_a_fifo_as_config_json_of_a_finished_run_is_a_clear_error(
    finished: tuple[Path, Path], tmp_path: Path, train_cli: ForkedCli
) -> None:
    run_dir, data_dir = finished
    copy = shutil.copytree(run_dir, tmp_path / "run", symlinks=True)
    (copy / "result.json").unlink()  # so that the trainer goes on to check config.json
    make_fifo(copy / "config.json")
    done = train_cli.run(["train", *train_args(copy, data_dir, epochs=1)], timeout=DEADLINE_S)
    assert done.returncode == 2, done.stderr
    assert "config.json is unreadable" in done.stderr and "a FIFO" in done.stderr, done.stderr


@pytest.mark.parametrize(
    "planted,expected",
    [
        ("fifo", "result.json is unreadable ("),
        ('{"status": "finished", "epochs": "1"}', "result.json is not a finished run's result"),
        ("[1, 2]", "result.json is not a finished run's result"),
    ],
    ids=["fifo", "epochs-a-string", "a-list"],
)
def test_a_finished_runs_result_json_that_is_not_its_record_is_a_clear_error(
    finished: tuple[Path, Path], tmp_path: Path, train_cli: ForkedCli, planted: str, expected: str
) -> None:
    """How many epochs a finished run trained decides between "nothing to do" and continuing
    it: a result.json that does not say is refused naming it, and nothing is written."""
    run_dir, data_dir = finished
    copy = shutil.copytree(run_dir, tmp_path / "run", symlinks=True)
    (copy / "result.json").unlink()
    if planted == "fifo":
        make_fifo(copy / "result.json")
    else:
        (copy / "result.json").write_text(planted)
    config = (copy / "config.json").read_bytes()
    done = train_cli.run(["train", *train_args(copy, data_dir, epochs=1)], timeout=DEADLINE_S)
    assert done.returncode == 2, done.stdout + done.stderr
    assert expected in done.stderr and "HINT: restore it; or move it aside" in done.stderr
    assert planted != "fifo" or "a FIFO" in done.stderr, done.stderr
    assert (copy / "config.json").read_bytes() == config
    assert sorted(p.name for p in (copy / "checkpoints").glob("step-*")) == sorted(
        p.name for p in (run_dir / "checkpoints").glob("step-*")
    )


def test_status_of_a_run_dir_whose_records_are_fifos_answers_at_once(
    finished: tuple[Path, Path], tmp_path: Path
) -> None:
    copy = shutil.copytree(finished[0], tmp_path / "run", symlinks=True)
    for name in ("progress.json", "result.json", ".run.lock.owner"):
        make_fifo(copy / name)
    done = run([HPC_DDP, "status", str(copy)], timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr
    assert "(run dir): UNKNOWN" in done.stdout, done.stdout  # no result read from a FIFO


def test_read_json_refuses_what_is_not_a_small_regular_file(tmp_path: Path) -> None:
    with pytest.raises(regular_file.NotRegularFileError, match="a FIFO"):
        regular_file.read_json(make_fifo(tmp_path / "fifo.json"))
    (tmp_path / "big.json").write_text("[" + "0," * 600 + "0]")
    with pytest.raises(regular_file.FileTooLargeError):
        regular_file.read_json(tmp_path / "big.json", limit=1000)
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)  # RecursionError inside
    with pytest.raises(ValueError, match="nested too deeply"):
        regular_file.read_json(tmp_path / "deep.json")
    (tmp_path / "ok.json").write_text('{"step": 3}')
    assert regular_file.read_json(tmp_path / "ok.json") == {"step": 3}


def test_progress_json_names_its_slurm_job_only_from_valid_variables() -> None:
    """progress.json records the job and restart count from Slurm's variables (what `status
    RUN_DIR` shows once the run ended), and nothing from values that are no job id or count."""
    from hpc_ddp.run_dir.paths import slurm_attempt

    ok = {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "2"}
    assert slurm_attempt(ok) == {"id": "12", "restarts": 2}
    task = {"SLURM_JOB_ID": "15", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm_attempt(task) == {"id": "12_3", "restarts": 0}  # as squeue shows it
    for bad in ({}, {"SLURM_JOB_ID": "0"}, {"SLURM_JOB_ID": "12\n"}, {"SLURM_JOB_ID": "１２"}):
        assert slurm_attempt(bad) is None, bad
    for count in ("³", "-1", "70000", "1 "):
        assert slurm_attempt({"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": count}) is None
