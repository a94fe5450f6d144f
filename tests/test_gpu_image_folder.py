"""An image folder from disk (``--dataset imagefolder``) on two CUDA GPUs: a generated folder of
PNGs, decoded by DataLoader workers chosen from the cores, batches pinned and normalised on the
GPU, the default (captured) step, under real torchrun with NCCL; interrupted by a real SIGUSR1
mid-epoch and resumed, ending bit-identical to the uninterrupted run. Needs two CUDA GPUs and
skips cleanly where fewer are visible (CI has none).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_image_folder import CLASSES, PER_CLASS, SIZE, TEST_PER_CLASS, folder_settings
from trainer_helpers import assert_resumed_like, interrupt_at, read_result, train_args

from hpc_ddp.train import image_synthetic

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def command(run_dir: Path, data: Path, *extra: str) -> list[str]:
    args = train_args(run_dir, data, **folder_settings())
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*torchrun, "--nproc-per-node=2", "-m", "hpc_ddp.train", *args, *extra]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}


@pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, {GPUS} visible")
def test_image_folder_on_two_gpus_captured_resumed_bit_identical(tmp_path: Path) -> None:
    data = image_synthetic.write_image_folder(
        tmp_path / "images", classes=CLASSES, train_per_class=PER_CLASS,
        test_per_class=TEST_PER_CLASS, size=SIZE,
    )  # fmt: skip
    ref = tmp_path / "ref"
    done = subprocess.run(
        command(ref, data), env=env(), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = done.stdout + done.stderr
    assert "CUDA graphs: on" in log, log[-3000:]
    assert "persistent, pinned memory" in log, log[-3000:]
    assert read_result(ref)["world_size"] == 2

    run_dir = tmp_path / "run"
    rc, first = interrupt_at(
        command(run_dir, data, "--debug-hold-at-step", "6"), run_dir, tmp_path / "first.log"
    )
    assert rc != 0 and "checkpointed at step 6" in first, first[-3000:]
    again = subprocess.run(
        command(run_dir, data), env=env(), capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert_resumed_like(run_dir, ref, interruptions=1, steps=12)
