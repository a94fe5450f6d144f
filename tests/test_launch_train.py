"""The project's trainer started by ``hpc-ddp launch`` on two "hosts" ends with the same weights as
the same job on one host (same world size, same seed): its 2 ranks forked from one interpreter,
which end as ``torchrun --standalone``'s do (tests/test_spawn.py), for a third of the start-up.

The two hosts node0/node1 are pdsh's and clush's ``exec`` workers on this machine (no second
physical host exists here); the master address is 127.0.0.1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch_support import (
    Launch,
    assert_no_processes_left,
    hpc_ddp,
    kill_leftovers,
    launch_args,
)
from trainer_helpers import forked_cmd, run

TRAIN = ["--synthetic", "--synthetic-train-size", "256", "--synthetic-test-size", "64",
         "--epochs", "2", "--batch-size", "32", "--seed", "7", "--no-plot"]  # fmt: skip


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``hpc-ddp train --nproc-per-node 2``: the single-host run to match."""
    tmp = tmp_path_factory.mktemp("ref")
    (tmp / "data").mkdir()
    args = [*TRAIN, "--run-dir", str(tmp / "run"), "--data-dir", str(tmp / "data")]
    proc = run(forked_cmd(2, args), timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = _result(tmp / "run")
    assert result["status"] == "finished" and result["world_size"] == 2
    return result


@pytest.mark.parametrize(("tool", "mode"), [("pdsh", "torchrun"), ("clush", "processes")])
def test_two_host_launch_matches_a_single_host_run(
    tool: str, mode: str, reference: dict, tmp_path: Path
) -> None:
    launch: Launch = launch_args(tool, tmp_path, mode=mode)
    (tmp_path / "data").mkdir()
    try:
        res = hpc_ddp(
            [*launch.base, "--", *TRAIN, "--run-dir", str(tmp_path / "run"),
             "--data-dir", str(tmp_path / "data")],
            timeout=180,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-4000:]
        result = _result(tmp_path / "run")
        assert result["world_size"] == 2 and result["status"] == "finished"
        assert result["params_sha256"] == reference["params_sha256"]
        assert result["steps"] == reference["steps"]
        assert_no_processes_left(launch.launch_id)
    finally:
        kill_leftovers(launch.launch_id)
