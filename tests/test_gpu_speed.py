"""GPU checks of the faster step: ``hpc_ddp.speed_up`` on CUDA (channels_last, the fused
optimizer, the same learning), the GPU-resident batches in channels_last, and the trainer's exact
resume with its new defaults (ResNet-18 in bf16, channels_last, fused SGD, background
checkpoints; captured and eager).

Every test needs a CUDA GPU and skips cleanly where none is visible (CI has none); tests/test_gpu.py
provides the synthetic data and the run helpers. Nothing is mocked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_gpu import (  # noqa: F401  (data_dir: the module's fixture, used by name)
    RESNET_BF16,
    TEST,
    TRAIN,
    cifar_both_ways,
    data_dir,
    deterministic_probe,
    flags,
    need,
    preempted_and_resumed,
    result,
    run,
)
from torch import nn

import hpc_ddp

pytestmark = pytest.mark.gpu


def _net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1, stride=2, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


@need(1)
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_speed_up_on_cuda_is_channels_last_and_fused_and_learns_alike(optimizer: str) -> None:
    """The one line on a CUDA model: channels_last weights and activations, the fused kernel,
    and the same loss curve as the model without it (bf16: not bit-equal, close)."""
    dev = torch.device("cuda", 0)
    make = {
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=5e-4),
        "adamw": lambda p: torch.optim.AdamW(p, lr=2e-3, weight_decay=5e-4),
    }[optimizer]
    g = torch.Generator(device=dev).manual_seed(0)
    centres = torch.randn(10, 3, 16, 16, device=dev, generator=g)
    curves = {}
    for fast in (False, True):
        torch.manual_seed(0)
        net = _net().to(dev)
        opt = make(net.parameters())
        lines: list[str] = []
        if fast:
            sped = hpc_ddp.speed_up(net, opt, log=lines.append)
            net, opt = sped
            name = type(opt).__name__
            assert lines == [sped.line] == [f"step: channels_last (2 Conv2d), fused {name}"]
            assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
            assert all(group["fused"] for group in opt.param_groups)
        data = torch.Generator(device=dev).manual_seed(1)
        losses = []
        for _ in range(60):
            y = torch.randint(0, 10, (128,), device=dev, generator=data)
            x = centres[y] + torch.randn(128, 3, 16, 16, device=dev, generator=data)
            if fast:
                x = x.contiguous(memory_format=sped.memory_format)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(net(x).float(), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[fast] = losses
    plain, fast_ = curves[False], curves[True]
    for curve in (plain, fast_):  # both learnt: the last ten steps well under the first ten
        assert sum(curve[-10:]) < 0.5 * sum(curve[:10]), curve
    for a, b in zip(plain[::10], fast_[::10], strict=True):
        assert abs(a - b) < 0.1 * a + 0.05, (plain, fast_)


@need(1)
def test_gpu_resident_batches_come_channels_last_with_the_loaders_values(data_dir) -> None:  # noqa: F811
    """The resident split laid out in the model's format (the trainer's StepPlan.feed): every
    batch channels_last on the GPU, the torchvision loader's values bit for bit."""
    from hpc_ddp.train.fast.choice import StepPlan

    cpu, resident, evaluation = cifar_both_ways(data_dir)
    StepPlan.feed(torch.channels_last, resident, evaluation)
    n = 0
    for (xc, yc), (xg, yg) in zip(cpu.batches(1, 0), resident.batches(1, 0), strict=True):
        assert xg.is_cuda and xg.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(xg.cpu(), xc) and torch.equal(yg.cpu(), yc)
        n += 1
    assert n > 5
    assert all(
        x.is_contiguous(memory_format=torch.channels_last) for x, _ in evaluation.batches(64)
    )


@need(1)
@pytest.mark.parametrize("step", [[], ["--no-cuda-graphs"]], ids=["captured", "eager"])
def test_resnet18_resume_exact_with_the_new_defaults(data_dir, tmp_path, step) -> None:  # noqa: F811
    """Preempted mid-epoch 2 and resumed == uninterrupted, bit for bit (deterministic kernels),
    with what a user types: channels_last, fused SGD, background checkpoints (whose restore
    gives momentum back contiguous, laid out again as its weight)."""
    extra = (*RESNET_BF16, "--batch-size", "64", "--optimizer", "sgd", "--lr", "0.05")
    extra = (*extra, "--epochs", "2", *step)
    probe = deterministic_probe("spawn", 1)
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    out = run(
        [*probe, "--probe-json", str(tmp_path / "a.json"), "--", *flags(data_dir, straight, *extra)]
    ).stdout
    lines = out.splitlines()
    graphs = next(i for i, line in enumerate(lines) if line.startswith("CUDA graphs: "))
    assert lines[graphs + 1] == "step: channels_last (20 Conv2d), fused SGD", out
    assert lines[graphs].startswith("CUDA graphs: on" if not step else "CUDA graphs: off"), out
    assert "GPU-resident" in out, out
    hold_at = TRAIN // 64 + 5  # inside epoch 2
    preempted_and_resumed(probe, data_dir, broken, extra, hold_at, tmp_path, timeout=180)
    a, c = result(straight), result(broken)
    assert c["interruptions"] == 1 and c["steps"] == a["steps"] == 2 * TRAIN // 64
    assert a["extra"]["cuda_graphs"] is not bool(step)
    assert c["params_sha256"] == a["params_sha256"]
