"""The latency-bound advice: the arithmetic it counts and when it speaks. (In a GPU run:
tests/test_gpu.py, LeNet says it, ResNet-18 does not.)"""

from __future__ import annotations

import torch
from torch import nn

from hpc_ddp.train.cifar.models import build_model
from hpc_ddp.train.fast.step_rate import ForwardFlops, latency_bound_line

# LeNet for 32x32x3 and 100 classes, multiply-adds per sample, by hand:
LENET_MACS = (
    6 * 28 * 28 * 3 * 5 * 5  # conv1
    + 16 * 10 * 10 * 6 * 5 * 5  # conv2
    + 400 * 120
    + 120 * 84
    + 84 * 100
)


def test_counts_lenets_arithmetic_once_per_module() -> None:
    net = build_model("lenet", 100)
    flops = ForwardFlops()
    with flops.counting(net):
        net(torch.zeros(8, 3, 32, 32))
        net(torch.zeros(3, 3, 32, 32))  # a second batch adds nothing
    assert flops.per_sample == 2 * LENET_MACS
    net(torch.zeros(2, 3, 32, 32))  # the hooks are gone
    assert flops.per_sample == 2 * LENET_MACS


def test_grouped_convolutions_and_sequence_inputs() -> None:
    model = nn.Sequential(nn.Conv1d(4, 8, 3, groups=2))
    linear = nn.Linear(6, 5)
    flops = ForwardFlops()
    with flops.counting(model), flops.counting(linear):
        model(torch.zeros(2, 4, 10))  # output 8 x 8 per sample, each from 2 channels x 3 taps
        linear(torch.zeros(2, 7, 6))  # 7 positions x 5 outputs, each from 6 inputs
    assert flops.per_sample == 2 * (8 * 8 * 2 * 3 + 7 * 5 * 6)


def test_speaks_for_a_latency_bound_step_only() -> None:
    lenet = 2.0 * LENET_MACS
    line = latency_bound_line(lenet, 64, 0.39e-3)  # LeNet's captured step on an H200
    assert line is not None and "bound by kernel latency" in line and "0.25 GFLOP" in line
    # ResNet-18 on CIFAR, bf16, 256 per GPU, ~11 ms a step: tens of TFLOP/s.
    assert latency_bound_line(1.11e9, 256, 11e-3) is None
    assert latency_bound_line(0.0, 64, 1e-3) is None  # nothing counted: no claim


def test_the_trainers_advice_counts_first_and_speaks_once_after_the_second_epoch() -> None:
    from hpc_ddp.train.fast.step_rate import LatencyAdvice

    net = build_model("lenet", 100)
    advice = LatencyAdvice(enabled=True)
    with advice.evaluating(net):
        net(torch.zeros(4, 3, 32, 32))
    assert advice.epoch_ended(0.5, 100, 64) is None  # epoch 1: CUDA's first use, not judged
    with advice.evaluating(net):  # later evaluations count nothing more
        net(torch.zeros(4, 3, 32, 32))
    assert advice.flops.per_sample == 2 * LENET_MACS
    line = advice.epoch_ended(0.039, 100, 64)  # 0.39 ms a step
    assert line is not None and "0.39 ms" in line
    assert advice.epoch_ended(0.039, 100, 64) is None  # said once
    off = LatencyAdvice(enabled=False)  # CPU runs, ranks other than 0
    with off.evaluating(net):
        net(torch.zeros(4, 3, 32, 32))
    assert off.flops.per_sample == 0 and off.epoch_ended(1.0, 1, 1) is None
    assert off.epoch_ended(0.039, 100, 64) is None
