"""``RunPaths`` names every file a real trainer run leaves, where it leaves it; torch-free.

The trainer and the checkpoint package read every name from RunPaths; the run below fails the
day a file lands elsewhere, the scan below the day another module spells a name itself.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from trainer_helpers import run, single_cmd, train_args

from hpc_ddp.run_dir.paths import RunPaths


def test_import_is_torch_free() -> None:
    code = "import sys, hpc_ddp.run_dir; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_real_run_leaves_every_file_where_run_paths_says(tmp_path: Path, data_dir: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    argv = train_args(paths.root, data_dir, epochs=1, checkpoint_every_steps=4, plot=True)
    done = run(single_cmd(argv), timeout=300)
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


def test_each_name_is_spelled_only_in_the_run_dir_paths() -> None:
    """No other module of the package spells a run dir name: the trainer, the checkpoints and
    deploy read them from RunPaths, so the layout cannot drift between them."""
    from hpc_ddp.run_dir import paths

    names = [paths.MARKER, paths.LOCK, paths.LOCK_OWNER, paths.CONFIG]
    names += [paths.PROGRESS, paths.METRICS, paths.RESULT, paths.PLOT]
    names += [paths.METRICS_CSV]  # TENSORBOARD is also the format's and package's name
    names += [paths.CHECKPOINTS, paths.LATEST, paths.MANIFEST]
    names += [paths.REQUEUE_MARKER_PREFIX]
    package = Path(paths.__file__).parents[1]
    spelled = [
        f"{path.relative_to(package)}:{node.lineno}: {node.value}"
        for path in sorted(package.rglob("*.py"))
        if path != Path(paths.__file__)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not spelled, spelled
    from hpc_ddp.checkpoint import manifest

    assert manifest.step_dir_name(12) == RunPaths("r").step_dir(12).name


def test_nccl_trace_is_wanted_only_where_the_dump_prefix_points_into_it(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "run")
    inside = {"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/run/nccl_trace/rank_"}
    assert paths.wants_nccl_trace(inside)
    assert not paths.wants_nccl_trace({})
    assert not paths.wants_nccl_trace({"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/elsewhere/rank_"})
    assert not paths.wants_nccl_trace({"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/run/rank_"})
