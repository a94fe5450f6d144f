"""The CUDA warm-up (hpc_ddp.train.cuda_warmup): which runs it applies to, and that its work
draws nothing from the random generators and touches no state of the run. The work itself runs
here on the CPU (the same code path, a CPU device); on GPUs tests/test_gpu.py checks that a run
ends with the same weights with and without it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpc_ddp.runtime import rng
from hpc_ddp.train import registry
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.cuda_warmup import CudaWarmup

CUDA = torch.device("cuda", 0)  # never touched: start() decides before any CUDA call


def test_registered_datasets_declare_their_shape_plugins_do_not() -> None:
    assert registry.dataset_shape("cifar10") == ((3, 32, 32), 10)
    assert registry.dataset_shape("cifar100") == ((3, 32, 32), 100)
    assert registry.dataset_shape("my_module:my_data") is None


@pytest.mark.parametrize(
    ("why", "settings", "device", "devices", "env"),
    [
        ("not a CUDA device", {}, torch.device("cpu"), 1, None),
        ("one process drives several GPUs", {}, CUDA, 2, None),
        ("a plug-in model", {"model": "my_module:my_net"}, CUDA, 1, None),
        ("a plug-in dataset", {"dataset": "my_module:my_data"}, CUDA, 1, None),
        ("turned off", {}, CUDA, 1, "0"),
    ],
)
def test_no_warmup_where_it_does_not_apply(
    monkeypatch, why, settings, device, devices, env
) -> None:
    if env is not None:
        monkeypatch.setenv("HPC_DDP_CUDA_WARMUP", env)
    assert CudaWarmup.start(TrainConfig(**settings), device, devices) is None, why


@pytest.mark.parametrize("model", ["lenet", "resnet18"])
def test_the_warmup_work_draws_no_random_numbers(model: str) -> None:
    rng.seed_everything(7)
    before = (torch.random.get_rng_state(), np.random.get_state()[1].copy())
    cfg = TrainConfig(model=model, dataset="cifar10", batch_size=4, eval_batch_size=8)
    warmup = CudaWarmup(cfg, torch.device("cpu"), registry.dataset_shape("cifar10"))
    warmup._forward_backward_step()  # what the thread runs on the GPU, here on the CPU
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1])
