"""hpc_ddp.early_cuda: when a process creates its CUDA contexts early, and that failures there
are only recorded. Whether torch adopts the early context is checked on GPUs
(tests/test_gpu.py::test_torch_adopts_the_early_cuda_context); no GPU exists on the CI machines,
so here a fake /proc with an NVIDIA driver directory stands in for one where noted.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpc_ddp import early_cuda


def fake_proc(tmp_path: Path, gpus: int) -> str:
    """A /proc whose NVIDIA driver knows ``gpus`` GPUs (no GPU or driver exists here)."""
    for index in range(gpus):
        (tmp_path / "driver" / "nvidia" / "gpus" / f"0000:0{index}:00.0").mkdir(parents=True)
    (tmp_path / "driver" / "nvidia").mkdir(parents=True, exist_ok=True)
    return str(tmp_path)


def test_wanted_only_with_a_driver_visible_gpus_and_the_switch_on(tmp_path: Path) -> None:
    with_gpus = fake_proc(tmp_path / "two", 2)
    assert early_cuda.wanted({}, with_gpus)
    assert not early_cuda.wanted({"HPC_DDP_EARLY_CUDA": "0"}, with_gpus)
    assert not early_cuda.wanted({"CUDA_VISIBLE_DEVICES": ""}, with_gpus)
    assert not early_cuda.wanted({}, fake_proc(tmp_path / "none", 0))
    assert not early_cuda.wanted({"CUDA_VISIBLE_DEVICES": "0"}, str(tmp_path / "no-driver"))


def test_nothing_starts_once_torch_is_imported() -> None:
    code = (
        "import torch\n"
        "from hpc_ddp import early_cuda\n"
        "early_cuda.wanted = lambda *a, **k: True\n"
        "assert early_cuda.start() is None\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("devices", [(999,)])
def test_a_failure_is_recorded_not_raised(devices: tuple[int, ...]) -> None:
    """No device 999 exists anywhere; here libcuda itself is missing. Either way the error is
    kept for the report and the caller carries on (torch makes the context and reports)."""
    contexts = early_cuda.EarlyContexts(devices)
    contexts.run()
    assert contexts.error and ("libcuda" in contexts.error or "cuDeviceGet(999)" in contexts.error)
    assert contexts.finished is not None and contexts.handles == []
