"""The preflight line of a real ``python -m hpc_ddp.deploy.preflight`` process (no torch)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ENVS = Path(__file__).parent / "data" / "envs"
# A recorded srun task (2 nodes x 2 tasks), rank 3, as the preflight step sees it.
SRUN = json.loads((ENVS / "slurm_srun_2x2.json").read_text())["processes"][3]["environ"]


def _preflight(**changes: str | None) -> str:
    env = {k: v for k, v in SRUN.items() if k != "CUDA_VISIBLE_DEVICES"}
    env.update({k: v for k, v in changes.items() if v is not None})
    env.update(MASTER_ADDR="127.0.0.1", PYTHONPATH=str(Path(__file__).parents[1]))
    done = subprocess.run(
        [sys.executable, "-m", "hpc_ddp.deploy.preflight"],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_cpu_task_says_cpu() -> None:
    """No GPU bound: ``device=CPU``, not ``gpus=- gpus_per_process=1 CUDA_VISIBLE_DEVICES=-``."""
    line = _preflight()
    assert line.startswith("hpc-ddp preflight: rank=3/4 ") and line.endswith(" device=CPU\n"), line
    assert "gpus" not in line and "CUDA_VISIBLE_DEVICES" not in line, line


def test_a_gpu_task_lists_its_gpus() -> None:
    line = _preflight(CUDA_VISIBLE_DEVICES="0,1")
    assert line.endswith(" gpus=1 gpus_per_process=1 CUDA_VISIBLE_DEVICES=0,1\n"), line
    assert "device=CPU" not in line, line
