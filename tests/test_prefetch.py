"""The torch._dynamo prefetch (hpc_ddp/train/fast/prefetch.py), in fresh interpreters.

Its first stage must not import torch._dynamo: ``dist.init_process_group`` would then wait for
the whole import. That depends on the installed torch, so it is checked against it.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import job_env, train_args

from hpc_ddp.train.config import TrainConfig

SCRIPT = """
import importlib, sys, time
import torch
from hpc_ddp.train.fast.prefetch import STAGE_ONE, TARGET, DynamoPrefetch

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


def test_only_eager_ddp_runs_are_prefetched() -> None:
    """Ranks of a job of two on GPUs, eager: DDP, so yes; captured, or over Gloo (averaged
    without DDP), or a job of one process: no; a run the trainer will refuse (bf16 on a CPU,
    --cuda-graphs on a CPU, NCCL without a GPU) imports nothing, so no. Pretended GPUs: the
    rule reads only the rank's view (DistEnv.gpus)."""
    from hpc_ddp.cluster import detect_env
    from hpc_ddp.train.fast.prefetch import needs_dynamo

    cpu_alone = detect_env({})
    cpu = dataclasses.replace(cpu_alone, world_size=2, local_world_size=2)
    gpu = dataclasses.replace(cpu, gpus=(0,))
    assert needs_dynamo(TrainConfig(cuda_graphs="off"), gpu)
    assert not needs_dynamo(TrainConfig(cuda_graphs="off", backend="gloo"), gpu)
    assert not needs_dynamo(TrainConfig(), cpu)  # Gloo
    assert not needs_dynamo(TrainConfig(), cpu_alone)
    assert not needs_dynamo(TrainConfig(amp="bf16"), cpu)
    assert not needs_dynamo(TrainConfig(cuda_graphs="on"), cpu)  # refused: needs a GPU
    assert not needs_dynamo(TrainConfig(backend="nccl"), cpu)  # refused: no GPU


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_cpu_job_never_imports_torch_dynamo(tmp_path: Path, data_dir: Path, nproc: int) -> None:
    """``hpc-ddp train --nproc-per-node N`` on the CPU: one process has no peer to average
    with (no DDP wrapper, nor the prefetch of its import), two average over Gloo without DDP,
    so no process imports torch._dynamo (``-X importtime`` prints every import of every
    process, forked ones included)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "hpc_ddp.cli", "train", "--nproc-per-node"]
    cmd += [str(nproc), *train_args(tmp_path / "run", data_dir, epochs=1)]
    done = subprocess.run(
        cmd, env=job_env(), capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{nproc} process(es)" in done.stdout and "backend gloo" in done.stdout, done.stdout
    # torch._dynamo's heaviest module, once per process that imports it.
    assert not re.findall(r"^import time:.*\| +torch\._dynamo\.convert_frame$", done.stderr, re.M)


DDP_OF_ONE = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from hpc_ddp.train.cifar import models
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
grads = []
for wrap in (False, True):
    torch.manual_seed(0)
    net = models.build_model("lenet", 10)
    model = DDP(net) if wrap else net
    x = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    y = torch.arange(16) % 10
    torch.nn.functional.cross_entropy(model(x), y).backward()
    grads.append([p.grad.clone() for p in net.parameters()])
assert len(grads[0]) == len(grads[1]) > 0
assert all(torch.equal(a, b) for a, b in zip(*grads)), "DDP of one process changed a gradient"
print("SAME")
"""


def test_ddp_of_one_process_changes_no_gradient() -> None:
    """Why a job of one process may skip DDP: its all-reduce over one rank and division by a
    world size of 1 leave every gradient as it was, bit for bit."""
    done = subprocess.run(
        [sys.executable, "-c", DDP_OF_ONE],
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0 and "SAME" in done.stdout, done.stderr[-3000:]
