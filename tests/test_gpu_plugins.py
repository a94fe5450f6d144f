"""Plug-in model and dataset (``--model FILE:FUNCTION --dataset FILE:FUNCTION``) on two CUDA
GPUs: the user's MLP and Gaussian blobs (tests/test_plugins.py's plug-in file) under real
torchrun with NCCL, taking the default step (captured when it qualifies, which this run does),
interrupted by a real SIGUSR1 mid-epoch and resumed, ending bit-identical to the uninterrupted
run. Needs two CUDA GPUs and skips cleanly where fewer are visible (CI has none).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_plugins import PLUGIN, plugin_settings
from trainer_helpers import assert_resumed_like, interrupt_at, read_result, train_args

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def command(run_dir: Path, plugin: Path, *extra: str) -> list[str]:
    args = train_args(run_dir, run_dir.parent / "no-data", **plugin_settings(plugin))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*torchrun, "--nproc-per-node=2", "-m", "hpc_ddp.train", *args, *extra]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, {GPUS} visible")
def test_plugin_on_two_gpus_captured_resumed_bit_identical(tmp_path: Path) -> None:
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(PLUGIN)

    ref = tmp_path / "ref"
    done = subprocess.run(
        command(ref, plugin), env=env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "CUDA graphs: on" in log, log[-3000:]  # the default chose the captured step
    reference = read_result(ref)
    assert reference["world_size"] == 2 and reference["test_accuracy"] >= 0.9, reference

    run_dir = tmp_path / "run"
    rc, first = interrupt_at(
        command(run_dir, plugin, "--debug-hold-at-step", "5"), run_dir, tmp_path / "first.log"
    )
    assert rc != 0 and "exitcode  : 75" in first, first[-3000:]  # torchrun: workers' 75
    assert "checkpointed at step 5" in first, first[-3000:]

    again = subprocess.run(
        command(run_dir, plugin), env=env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    # Same steps, same weights bit for bit, same loss curve as the uninterrupted run.
    assert_resumed_like(run_dir, ref, interruptions=1, steps=reference["steps"])
