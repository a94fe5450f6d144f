"""``RunPaths`` names every file a real trainer run leaves, where it leaves it; torch-free.

The trainer and the checkpoint package still spell some of these names themselves (they move to
RunPaths next): the run below, and the constants compared here, fail the day the two disagree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainer_helpers import job_env, train_args

from hpc_ddp.runtime.run_paths import RunPaths


def test_import_is_torch_free() -> None:
    code = "import sys, hpc_ddp.runtime.run_paths; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_real_run_leaves_every_file_where_run_paths_says(tmp_path: Path, data_dir: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    argv = train_args(paths.root, data_dir, epochs=1, checkpoint_every_steps=4)
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.train", *argv],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    for path in (paths.marker, paths.config, paths.progress, paths.metrics, paths.plot):
        assert path.is_file(), path
    assert json.loads(paths.result.read_text())["status"] == "finished"
    assert json.loads(paths.config.read_text())["run_dir"] == str(paths.root)
    latest = paths.latest.read_text().strip()
    step = int(latest.removeprefix("step-"))
    assert paths.step_dir(step) == paths.checkpoints / latest
    assert json.loads(paths.manifest(step).read_text())["step"] == step
    # The lock lives where RunPaths says: the file stays, its owner record goes with the run.
    assert paths.lock.is_file() and not paths.lock_owner.exists()
    assert os.fspath(paths) == str(paths.root)


def test_the_names_agree_with_the_trainer_and_the_checkpoints() -> None:
    from hpc_ddp.checkpoint import lock, manifest
    from hpc_ddp.train import results, run_marker

    paths = RunPaths("r")
    assert paths.marker.name == run_marker.MARKER
    assert (paths.lock.name, paths.lock_owner.name) == (lock.LOCK_FILE, lock.OWNER_FILE)
    assert paths.config.name == results.CONFIG and paths.result.name == results.RESULT
    assert (paths.metrics.name, paths.plot.name) == (results.METRICS, results.PLOT)
    assert paths.progress.name == results.PROGRESS
    assert paths.latest.name == manifest.LATEST
    assert paths.manifest(12).name == manifest.MANIFEST
    assert paths.step_dir(12).name == manifest.step_dir_name(12)
