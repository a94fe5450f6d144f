"""The CUDA warm-up beside the process group (hpc_ddp/train/fast/kernel_warmup.py).

Its promise is to change nothing the run computes. The miniature step runs on the CPU here with
the same code the GPU thread runs (no GPU in CI: tests/test_gpu.py runs it on one), so what it
draws from the random number generators and what it leaves behind is checked for real.
"""

from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import job_env, train_args

from hpc_ddp.cluster import detect_env
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.fast.kernel_warmup import KernelWarmup, warm_kernels
from hpc_ddp.train.optim import build_optimizer


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_the_miniature_step_draws_no_random_numbers(optimizer: str) -> None:
    cfg = TrainConfig(optimizer=optimizer)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    made: list[torch.optim.Optimizer] = []

    def make(params):
        made.append(build_optimizer(cfg, params))
        return made[0]

    warm_kernels(torch.device("cpu"), make, None)
    assert torch.equal(torch.get_rng_state(), before)
    # the optimizer really stepped: its state exists (Adam) or its parameters got gradients
    params = made[0].param_groups[0]["params"]
    assert all(p.grad is not None for p in params)
    if optimizer == "adam":
        assert len(made[0].state) == len(params)


def test_no_warmup_for_a_cpu_process() -> None:
    env = dataclasses.replace(detect_env({}), gpus=())  # a CPU rank, on any machine
    assert KernelWarmup.start(TrainConfig(), env) is None


def test_a_failed_warmup_is_logged_and_finish_returns(caplog) -> None:
    def broken(params):
        raise RuntimeError("no optimizer today")

    warmup = KernelWarmup([torch.device("cpu")], broken, None).launch()
    # hpc_ddp's logger does not propagate (hpc_ddp/log.py): caplog listens on it directly, as
    # pytest before 9 does not.
    hpc_logger = logging.getLogger("hpc_ddp")
    hpc_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level("WARNING", logger="hpc_ddp"):
            warmup.finish()
    finally:
        hpc_logger.removeHandler(caplog.handler)
    assert isinstance(warmup.error, RuntimeError)
    assert "the CUDA warm-up failed" in caplog.text and "no optimizer today" in caplog.text


def test_the_warmup_imports_no_torch_dynamo() -> None:
    """On the captured path nothing else imports it (prefetch.needs_dynamo), and its import
    takes seconds: a warm-up that pulled it in would hold up the join it is meant to hide in."""
    script = (
        "import sys, torch\n"
        "from hpc_ddp.train.config import TrainConfig\n"
        "from hpc_ddp.train.fast.kernel_warmup import warm_kernels\n"
        "from hpc_ddp.train.optim import build_optimizer\n"
        "warm_kernels(torch.device('cpu'), lambda p: build_optimizer(TrainConfig(), p), None)\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_a_deterministic_run_sets_cublas_up_before_the_warmup_uses_it(tmp_path: Path) -> None:
    """The warm-up is a GPU process's first cuBLAS user, and cuBLAS's workspace size is read
    once: ``--deterministic``'s CUBLAS_WORKSPACE_CONFIG must be set before ``train()`` starts
    it, not later where the model is built. Two real single-process runs in a fresh interpreter
    (the switch is process-wide), the settings read where ``train()`` starts the warm-up: no GPU
    here, so that is all the stand-in start does."""
    script = f"""
import argparse, os, torch
import hpc_ddp.train.trainer as trainer
from hpc_ddp.train import config
from hpc_ddp.train.fast.kernel_warmup import KernelWarmup

seen = []
def start(cfg, env):
    seen.append((torch.are_deterministic_algorithms_enabled(),
                 os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
KernelWarmup.start = start
for deterministic in (False, True):
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    argv = {train_args(tmp_path / "run", tmp_path / "data", epochs=1)!r}
    run_dir = {str(tmp_path)!r} + f"/run-{{deterministic}}"
    argv[argv.index("--run-dir") + 1] = run_dir
    argv += ["--deterministic"] if deterministic else []
    assert trainer.train(config.from_args(parser.parse_args(argv))).exit_code == 0
    print("SEEN", *seen[-1])
"""
    env = {k: v for k, v in job_env().items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("SEEN ")]
    assert seen == [["False", "None"], ["True", ":4096:8"]], done.stdout[-3000:]


def test_the_warmup_takes_the_runs_memory_format_and_fused_optimizer(monkeypatch) -> None:
    """channels_last kernels where the run's convolutions may be channels_last (any model under
    auto), and the optimizer hpc_ddp.speed_up will give the step (fused; the CPU
    stands in for the GPU through fast_step.FAST_DEVICES)."""
    from hpc_ddp.runtime import fast_step
    from hpc_ddp.train.fast.kernel_warmup import optimizer_factory, warms_channels_last

    assert warms_channels_last(TrainConfig())  # lenet, auto
    assert warms_channels_last(TrainConfig(model="mine:net", memory_format="channels_last"))
    assert warms_channels_last(TrainConfig(model="mine:net"))  # a plug-in may run in it
    assert not warms_channels_last(TrainConfig(memory_format="contiguous"))
    monkeypatch.setattr(fast_step, "FAST_DEVICES", ("cpu",))
    made: list[torch.optim.Optimizer] = []
    for fused in (True, False):
        cfg = TrainConfig(optimizer="sgd", fused_optimizer=fused)
        make = optimizer_factory(cfg, captured=False)
        torch.manual_seed(7)
        before = torch.get_rng_state()

        def keep(params: list, make=make) -> torch.optim.Optimizer:
            made.append(make(params))
            return made[-1]

        warm_kernels(torch.device("cpu"), keep, None, torch.channels_last)
        assert torch.equal(torch.get_rng_state(), before)
        conv_w = made[-1].param_groups[0]["params"][0]
        assert conv_w.is_contiguous(memory_format=torch.channels_last) and conv_w.grad is not None
        assert bool(made[-1].param_groups[0]["fused"]) is fused
