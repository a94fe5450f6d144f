"""The torch._dynamo prefetch (hpc_ddp/train/prefetch.py), in fresh interpreters.

Its first stage must not import torch._dynamo: ``dist.init_process_group`` would then wait for
the whole import. That depends on the installed torch, so it is checked against it.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

SCRIPT = """
import importlib, sys, time
import torch
from hpc_ddp.train.prefetch import STAGE_ONE, TARGET, DynamoPrefetch

def loaded(name):
    module = sys.modules.get(name)
    return module is not None and not getattr(module.__spec__, "_initializing", False)

def wait_for(condition, what):
    deadline = time.monotonic() + 120
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)

assert TARGET not in sys.modules
prefetch = DynamoPrefetch.start()
wait_for(lambda: all(loaded(name) for name in STAGE_ONE), "stage one never finished")
assert TARGET not in sys.modules, "stage one imported torch._dynamo"
prefetch.process_group_ready()
wait_for(lambda: loaded(TARGET), "stage two never imported torch._dynamo")
assert DynamoPrefetch.start() is None  # already imported: nothing to do
print("PREFETCH_OK")
"""


def test_stage_one_leaves_torch_dynamo_to_stage_two() -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, check=False
    )
    assert out.returncode == 0 and "PREFETCH_OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side (CI has no GPU)")
def test_runs_that_will_import_torch_dynamo_are_the_ones_prefetched() -> None:
    """On a machine without CUDA: eager DDP, so yes; a run the trainer will refuse (bf16 on a
    CPU, --cuda-graphs on a CPU) imports nothing, so no."""
    from hpc_ddp.cluster import detect_env
    from hpc_ddp.train.config import TrainConfig
    from hpc_ddp.train.prefetch import needs_dynamo

    env = detect_env({})
    assert needs_dynamo(TrainConfig(), env)
    assert not needs_dynamo(TrainConfig(amp="bf16"), env)
    assert not needs_dynamo(TrainConfig(cuda_graphs="on"), env)  # refused: needs a GPU
