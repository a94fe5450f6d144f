"""``--deterministic``: the trainer asks torch for deterministic kernels (exact GPU comparisons,
e.g. a preempted-and-resumed run against an uninterrupted one in benchmarks/slurm_gpu.py).

What can be checked without a GPU: the flag reaches the config, and the switch sets what torch
reads (checked in a fresh interpreter: the setting is process-wide)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from hpc_ddp.train import config


def test_flag_parses_and_defaults_off() -> None:
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    assert config.from_args(parser.parse_args([])).deterministic is False
    assert config.from_args(parser.parse_args(["--deterministic"])).deterministic is True


def test_switch_sets_torch_and_cublas() -> None:
    code = (
        "import os, torch\n"
        "from hpc_ddp.runtime import rng\n"
        "assert not torch.are_deterministic_algorithms_enabled()\n"
        "rng.use_deterministic_kernels()\n"
        "print(torch.are_deterministic_algorithms_enabled(),\n"
        "      torch.is_deterministic_algorithms_warn_only_enabled(),\n"
        "      torch.backends.cudnn.benchmark, os.environ['CUBLAS_WORKSPACE_CONFIG'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    argv = [sys.executable, "-c", code]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False", ":4096:8"]
