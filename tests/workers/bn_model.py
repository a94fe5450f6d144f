"""A plug-in model (``--model tests/workers/bn_model.py:small_bn``) with BatchNorm in it, for
the tests whose point is what DDP does to BatchNorm statistics, not the model's size: the same
questions as the built-in ResNet-18 asks, at a hundredth of its CPU time."""

from __future__ import annotations

from torch import nn


def small_bn(num_classes: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(4),
        nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, num_classes),
    )  # fmt: skip
