"""The torch._dynamo prefetch (hpc_ddp/train/prefetch.py), in fresh interpreters.

Its first stage must not import torch._dynamo: ``dist.init_process_group`` would then wait for
the whole import. That depends on the installed torch, so it is checked against it.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import job_env, train_args

from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.prefetch import import_before_fork

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
    """On a machine without CUDA, ranks of a job of two: eager DDP, so yes; a run the trainer
    will refuse (bf16 on a CPU, --cuda-graphs on a CPU) imports nothing, so no; nor does a job
    of one process, which has no DDP wrapper (checked in a real run below)."""
    from hpc_ddp.cluster import detect_env
    from hpc_ddp.train.prefetch import needs_dynamo

    alone = detect_env({})
    env = dataclasses.replace(alone, world_size=2, local_world_size=2)
    assert needs_dynamo(TrainConfig(), env)
    assert not needs_dynamo(TrainConfig(amp="bf16"), env)
    assert not needs_dynamo(TrainConfig(cuda_graphs="on"), env)  # refused: needs a GPU
    assert not needs_dynamo(TrainConfig(), alone)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side (CI has no GPU)")
def test_the_fork_parent_imports_torch_dynamo_only_for_cpu_workers_short_of_cores(
    tmp_path: Path,
) -> None:
    """No NVIDIA driver and nothing in CUDA_VISIBLE_DEVICES (the workers run eager DDP on the
    CPU) with fewer than two cores per worker: yes; anything else keeps the workers' own
    prefetch, and a run the trainer will refuse imports nothing. The driver is a directory
    under a stand-in /proc, as the real one would be."""
    cfg = TrainConfig()
    bare, gpu = tmp_path / "bare", tmp_path / "gpu"
    bare.mkdir()
    (gpu / "driver" / "nvidia" / "gpus" / "0000:01:00.0").mkdir(parents=True)
    assert import_before_fork(cfg, 2, {}, proc_root=str(bare), cores=2)
    assert import_before_fork(cfg, 4, {}, proc_root=str(bare), cores=7)
    assert not import_before_fork(cfg, 4, {}, proc_root=str(bare), cores=8)  # a core each to spare
    assert not import_before_fork(cfg, 1, {}, proc_root=str(bare), cores=1)  # no fork at all
    assert not import_before_fork(cfg, 2, {}, proc_root=str(gpu), cores=2)  # a GPU machine
    visible = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert not import_before_fork(cfg, 2, visible, proc_root=str(bare), cores=2)
    refused = TrainConfig(amp="bf16")  # bf16 on a CPU: refused before any import
    assert not import_before_fork(refused, 2, {}, proc_root=str(bare), cores=2)


@pytest.mark.skipif(
    not import_before_fork(TrainConfig(), 2, cores=1),
    reason="a machine with GPUs: its workers import their own",
)
def test_forked_cpu_workers_inherit_torch_dynamo_instead_of_importing_it(
    tmp_path: Path, data_dir: Path
) -> None:
    """On one core, ``hpc-ddp train --nproc-per-node 2`` imports torch._dynamo once, in the
    parent before the fork (``-X importtime`` prints every import of every process, forked ones
    included); each worker importing it would print it twice."""
    cmd = [sys.executable, "-X", "importtime", "-m", "hpc_ddp.cli", "train", "--nproc-per-node"]
    cmd += ["2", *train_args(tmp_path / "run", data_dir, epochs=1)]
    one_core = {min(os.sched_getaffinity(0))}
    done = subprocess.run(
        cmd,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        preexec_fn=lambda: os.sched_setaffinity(0, one_core),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # torch._dynamo's heaviest module, once per process that imports it (2 with each worker's).
    imports = re.findall(r"^import time:.*\| +torch\._dynamo\.convert_frame$", done.stderr, re.M)
    assert len(imports) == 1, imports


def test_a_job_of_one_process_never_imports_torch_dynamo(tmp_path: Path, data_dir: Path) -> None:
    """One process has no peer to average with: no DDP wrapper, so neither its torch._dynamo
    import nor the prefetch of it (state.build_state, needs_dynamo)."""
    cmd = [sys.executable, "-X", "importtime", "-m", "hpc_ddp.cli", "train"]
    cmd += train_args(tmp_path / "run", data_dir, epochs=1)
    done = subprocess.run(
        cmd, env=job_env(), capture_output=True, text=True, timeout=180, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 process(es)" in done.stdout, done.stdout
    # torch._dynamo's heaviest module (the line the inherited-import test above counts)
    assert not re.findall(r"^import time:.*\| +torch\._dynamo\.convert_frame$", done.stderr, re.M)


DDP_OF_ONE = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from hpc_ddp.cifar import models
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
