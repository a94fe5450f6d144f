"""``--metrics csv,tensorboard``: metrics.csv and TensorBoard's event files continue one run across
a preemption (a real SIGUSR1), a resume and a hard kill (a real SIGKILL after steps logged past
the last checkpoint), ending with the uninterrupted run's records: the same steps, none twice,
none missing, the same values. Two real Gloo ranks forked by ``hpc-ddp train --nproc-per-node 2``;
TensorBoard's files are read back with TensorBoard's own reader. What a user added to the files
is carried through a resume, and what the trainer did not write stops a real run before its
first step, left as it was. Nothing is mocked.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_forkserver import ForkedCli
from test_plugins import PLUGIN, plugin_settings
from trainer_helpers import (
    finish,
    forked_cmd,
    holding,
    interrupt_at,
    job_env,
    read_metrics,
    read_result,
    run,
    single_cmd,
    start,
    train_args,
    wait_for_progress,
)

from hpc_ddp.checkpoint.committed import read_latest
from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm.free_ports import free_ports
from hpc_ddp.run_dir.marker import claim_run_dir
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.slurm_client import wait_for
from hpc_ddp.train.metric_records import Record
from hpc_ddp.train.metrics_csv import COLUMNS, CsvWriter

HAVE_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
FORMATS = "csv,tensorboard" if HAVE_TENSORBOARD else "csv"
# 256 samples / (2 ranks x 16) = 8 steps per epoch, 2 epochs; a progress line every 2 steps.
SETTINGS = {"log_every": 2, "metrics": FORMATS}
# Equal in a bit-identical resume; throughput, times and per-attempt counters are not.
SAME_VALUES = ("train_loss", "lr", "test_loss", "test_accuracy", "test_samples",
               "test_samples_per_rank")  # fmt: skip


def spawn_cmd(run_dir: Path, data_dir: Path, *extra: str) -> list[str]:
    return forked_cmd(2, [*train_args(run_dir, data_dir, **SETTINGS), *extra])


def read_csv(run_dir: Path) -> list[dict[str, str]]:
    with RunPaths(run_dir).metrics_csv.open(newline="") as f:
        return list(csv.DictReader(f))


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """What TensorBoard shows: every scalar's (step, value) points, over all event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(RunPaths(run_dir).tensorboard), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def flat_text(row: dict[str, Any]) -> dict[str, str]:
    """A metrics.jsonl row as metrics.csv writes it."""
    out = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update({f"{key}_{k}": str(v) for k, v in value.items()})
        else:
            out[key] = json.dumps(value) if isinstance(value, list) else str(value)
    return out


@pytest.mark.slow
def test_csv_and_tensorboard_continue_across_a_preemption_and_a_kill(
    tmp_path: Path, data_dir: Path
) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    done = run(spawn_cmd(ref_dir, data_dir))
    assert done.returncode == 0, done.stderr

    # 1. SIGUSR1 at step 6, a progress line's step: the checkpoint holds its record.
    rc, log = interrupt_at(spawn_cmd(run_dir, data_dir, "--debug-hold-at-step", "6"),
                           run_dir, tmp_path / "1.log")  # fmt: skip
    assert rc == 75 and "checkpointed at step 6" in log, log
    # 2. Resumed, then SIGKILL at step 11: the epoch-end checkpoint is step 8, step 10 was
    #    logged after it. No handler runs; rank 0's files hold what it wrote before dying.
    log2 = tmp_path / "2.log"
    proc = start(spawn_cmd(run_dir, data_dir, "--debug-hold-at-step", "11"), log2)
    try:
        progress = wait_for_progress(run_dir, holding, proc)
        # The epoch-end checkpoint (step 8) is saved in the background: killed before its
        # commit, the run would rightly resume from step 6. Kill once it has committed: its
        # directory is renamed into place before `latest` names it, and only that commits it.
        root = run_dir / "checkpoints"
        wait_for(lambda: read_latest(root)[0] == "step-00000008", 60, "step 8 to commit")
        for pid in progress["pids"]:
            os.kill(pid, signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    rc, log = finish(proc, log2)
    assert rc != 0 and "killed by SIGKILL" in log, log
    assert [r["step"] for r in read_csv(run_dir)][-1] == "10"  # logged past the checkpoint
    # 3. Resumed from step 8 to the end.
    final = run(spawn_cmd(run_dir, data_dir))
    assert final.returncode == 0, final.stderr
    assert "resumed from" in final.stdout and "step 8)" in final.stdout, final.stdout
    assert read_result(run_dir)["params_sha256"] == read_result(ref_dir)["params_sha256"]

    rows, ref_rows = read_csv(run_dir), read_csv(ref_dir)
    logged = [(r["record"], r["epoch"], r["step"]) for r in rows]
    assert logged == [(r["record"], r["epoch"], r["step"]) for r in ref_rows]
    steps = [int(s) for kind, _, s in logged if kind == "step"]
    assert steps == [2, 4, 6, 8, 10, 12, 14, 16]  # each once, in order
    for row, ref in zip(rows, ref_rows, strict=True):
        assert {k: row[k] for k in SAME_VALUES} == {k: ref[k] for k in SAME_VALUES}, row
    # The epoch rows are metrics.jsonl's lines, field for field.
    epochs = [{k: v for k, v in r.items() if v != "" and k != "record"} for r in rows
              if r["record"] == "epoch"]  # fmt: skip
    assert epochs == [flat_text(line) for line in read_metrics(run_dir)]

    if not HAVE_TENSORBOARD:
        pytest.skip("tensorboard is not installed (pip install 'hpc-ddp[tensorboard]'); "
                    "metrics.csv was checked")  # fmt: skip
    shown, ref_shown = tensorboard_scalars(run_dir), tensorboard_scalars(ref_dir)
    assert len(list(RunPaths(run_dir).tensorboard.glob("events.out.tfevents.*"))) == 3
    assert set(shown) == set(ref_shown)
    assert [s for s, _ in shown["step/train_loss"]] == steps
    assert [s for s, _ in shown["epoch/test_accuracy"]] == [8, 16]
    for tag, points in shown.items():
        assert [s for s, _ in points] == [s for s, _ in ref_shown[tag]], tag
        if tag.split("/")[1] in SAME_VALUES:
            assert points == ref_shown[tag], tag


def test_tensorboard_missing_is_refused_at_startup_naming_the_extra(
    tmp_path: Path, data_dir: Path
) -> None:
    """The package is blocked in the trainer's interpreter (sys.modules entry None, as Python's
    import system does for a module that must not load): where it is installed, this is the
    only way to run without it."""
    code = (
        "import sys; sys.modules['tensorboard'] = None; "
        "from hpc_ddp.train.cli import main; main(sys.argv[1:])"
    )
    run_dir = tmp_path / "run"
    argv = train_args(run_dir, data_dir, metrics="tensorboard")
    done = subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "--metrics tensorboard needs tensorboard, which is not installed" in done.stderr
    assert "pip install 'hpc-ddp[tensorboard]'" in done.stderr
    assert not run_dir.exists()  # refused before the run dir was touched


def test_an_unknown_format_is_refused(tmp_path: Path, data_dir: Path, train_cli: ForkedCli) -> None:
    done = train_cli.run(["train", *train_args(tmp_path / "run", data_dir, metrics="csv,wandb")])
    assert done.returncode == 2
    assert "metrics: unknown format(s) 'wandb'" in done.stderr, done.stderr
    assert "jsonl, csv, tensorboard" in done.stderr


def _records(*steps: int) -> list[Record]:
    return [Record("step", {"epoch": 1, "step": s, "train_loss": s / 10, "lr": 0.1}) for s in steps]


def test_csv_drops_a_torn_row_and_the_rows_past_the_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    writer = CsvWriter.open(path, 0, [])
    for record in _records(10, 20, 30, 40):
        writer.write(record)
    writer.close()
    with path.open("a") as f:
        f.write("step,1,5")  # the row of step 50, cut inside its step number by a kill

    writer = CsvWriter.open(path, 30, _records(30))  # resumed at step 30, which it logged
    writer.write(_records(40)[0])
    writer.close()
    lines = path.read_text().splitlines()
    assert lines[0].startswith("record,epoch,step,train_loss,lr,")
    assert [line.split(",")[2] for line in lines[1:]] == ["10", "20", "30", "40"]
    assert lines[3].split(",")[3] == "3.0"


@pytest.mark.parametrize(
    ("content", "why"),
    [("name,score\nada,3\n", "has no record and step columns"),
     ("record,step\nstep,seven\n", "line 2 has no step number"),
     (b"\xff\xfe", "cannot be read back")],
)  # fmt: skip
def test_csv_refuses_a_file_it_did_not_write(
    tmp_path: Path, content: str | bytes, why: str
) -> None:
    path = tmp_path / "metrics.csv"
    data = content if isinstance(content, bytes) else content.encode()
    path.write_bytes(data)
    with pytest.raises(ConfigError, match=why):
        CsvWriter.open(path, 0, [])
    assert path.read_bytes() == data


def test_csv_never_follows_a_link(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_text("record,step\n")
    (tmp_path / "metrics.csv").symlink_to(target)
    with pytest.raises(ConfigError, match="cannot be read back"):
        CsvWriter.open(tmp_path / "metrics.csv", 0, [])
    assert target.read_text() == "record,step\n"


def test_tensorboard_itself_shows_one_series_after_a_resume(tmp_path: Path) -> None:
    """The real ``tensorboard --logdir`` server, with its default reader (the Rust data server,
    which drops a series' points from a step that comes again, not through purge markers): an
    attempt logged steps 1-10, the next resumed from a checkpoint of step 6, whose progress
    line it writes again. On 127.0.0.1 only."""
    pytest.importorskip("tensorboard", reason="pip install 'hpc-ddp[tensorboard]'")
    from hpc_ddp.train.metric_writers import open_writers
    from hpc_ddp.train.progress import Progress

    paths = RunPaths(tmp_path)

    def logged(step: int, value: float) -> dict[str, Any]:
        return {"epoch": 1, "step": step, "train_loss": value}

    def attempt(restored: Progress, steps: range, value: float) -> None:
        writers = open_writers(["tensorboard"], paths, restored)
        for step in steps:
            writers.write(Record("step", logged(step, value)))
        writers.close()

    attempt(Progress(), range(1, 11), 1.0)
    attempt(Progress(global_step=6, last_log=logged(6, 2.0)), range(7, 13), 2.0)
    port = free_ports(1)[0]
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(paths.tensorboard),
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=job_env(),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?run=.&tag=step/train_loss"
    try:
        deadline, points = time.monotonic() + 60, None
        while points is None and time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(url, timeout=5) as answer:
                    points = [(step, value) for _, step, value in json.load(answer)]
            except OSError:
                time.sleep(0.2)  # not serving yet, or not loaded yet; the deadline bounds it
    finally:
        server.terminate()
        server.wait(timeout=30)
    steps = list(range(1, 13))
    assert points == [(s, 1.0 if s < 6 else 2.0) for s in steps]  # 6-10 logged again


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    path = tmp_path / "my_plugin.py"
    path.write_text(PLUGIN)
    return path


def plugin_cmd(run_dir: Path, plugin: Path, metrics: str) -> list[str]:
    """One process training test_plugins' MLP for an epoch of 16 steps, a progress line every
    2 (a fraction of the CIFAR model's time)."""
    settings = {**plugin_settings(plugin), "epochs": 1, "log_every": 2, "metrics": metrics}
    return single_cmd(train_args(run_dir, run_dir.parent / "no-data", **settings))


def read_long_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """Header and rows of a file with fields past csv's default limit (restored after)."""
    limit = csv.field_size_limit(1 << 30)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            return list(reader.fieldnames or ()), list(reader)
    finally:
        csv.field_size_limit(limit)


def test_a_column_added_to_metrics_csv_is_carried_through_a_resume(
    tmp_path: Path, plugin: Path
) -> None:
    """A column the user added to metrics.csv, one of its values past csv's 128 KiB field limit,
    survives a real preemption (SIGUSR1) and resume: its values stay in the rows kept, and the
    rows logged after the resume leave it empty."""
    run_dir = tmp_path / "run"
    cmd = plugin_cmd(run_dir, plugin, "csv")
    rc, log = interrupt_at([*cmd, "--debug-hold-at-step", "5"], run_dir, tmp_path / "1.log")
    assert rc == 75 and "checkpointed at step 5" in log, log
    path = RunPaths(run_dir).metrics_csv
    header, rows = read_long_csv(path)
    assert [row["step"] for row in rows] == ["2", "4"]
    notes = {"2": "x" * (200 << 10), "4": 'lr too high?, see "run 3"'}
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, [*header, "notes"], lineterminator="\n")
        writer.writeheader()
        writer.writerows({**row, "notes": notes[row["step"]]} for row in rows)

    final = run(cmd)
    assert final.returncode == 0, final.stderr
    assert "resumed from" in final.stdout and "step 5)" in final.stdout, final.stdout
    header, rows = read_long_csv(path)
    assert header == [*COLUMNS, "notes"]
    logged = [(row["record"], row["step"]) for row in rows]
    assert logged == [("step", str(s)) for s in range(2, 17, 2)] + [("epoch", "16")]
    assert [row["notes"] for row in rows] == [notes["2"], notes["4"]] + [""] * 7


def _planted(path: Path) -> tuple[str, Any]:
    """What is at ``path``, to compare before and after: a link's target, a directory's names,
    a file's bytes."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "link", os.readlink(path)
    if stat.S_ISDIR(mode):
        return "dir", sorted(os.listdir(path))
    return "file", path.read_bytes()


def _directory(path: Path) -> None:
    path.mkdir()
    (path / "mine.txt").write_text("not the trainer's\n")


def _text(data: str | bytes) -> Callable[[Path], None]:
    return lambda path: path.write_bytes(data if isinstance(data, bytes) else data.encode())


PLANTED = [
    # (name in the run dir, what is put there, what the error says)
    ("tensorboard", _text("my notes\n"), "tensorboard is a file, not a directory"),
    ("tensorboard", lambda path: path.symlink_to(path.parent / "gone"),
     "tensorboard is a symbolic link to nothing, not a directory"),
    ("metrics.jsonl", _directory, "metrics.jsonl is a directory"),
    ("metrics.jsonl", _text("my own notes\n"), "metrics.jsonl line 1 is not JSON"),
    ("metrics.csv", _text("record,step,notes,notes\n"), "names the column(s) 'notes' twice"),
    ("metrics.csv", _text("record,step\nstep,1,surplus\n"),
     "line 2 has 3 fields, more than the header's 2"),
    ("metrics.csv", _text("record,step,notes\nstep,3,look at this\n"),
     "line 2 (step 3) has a value in the column(s) 'notes'"),
    ("metrics.csv", _text("record,step\nstep,1\rx\n"), "line 2 is not CSV (new-line character"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "plant", "expected"), PLANTED)
def test_a_metrics_file_that_is_not_ours_stops_the_run_before_training(
    tmp_path: Path, plugin: Path, name: str, plant: Callable[[Path], None], expected: str
) -> None:
    """A run dir of ours (its marker) holding at a metrics name something the trainer did not
    write, or could not rewrite without losing what it holds: a real run exits 2 before its
    first step, naming the file and the fix, and leaves it as it was."""
    if name == "tensorboard" and not HAVE_TENSORBOARD:
        pytest.skip("tensorboard is not installed (pip install 'hpc-ddp[tensorboard]')")
    run_dir = tmp_path / "run"
    claim_run_dir(run_dir)
    plant(run_dir / name)
    before = _planted(run_dir / name)
    done = run(plugin_cmd(run_dir, plugin, FORMATS))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"{run_dir / name} " in done.stderr and expected in done.stderr, done.stderr
    assert "HINT: " in done.stderr and "move " in done.stderr and "Traceback" not in done.stderr
    assert _planted(run_dir / name) == before
    assert not (run_dir / "result.json").exists()
    assert not list(RunPaths(run_dir).checkpoints.glob("step-*"))  # no step was trained
