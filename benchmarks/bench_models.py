"""Models the benchmarks bring through the trainer's plug-in contract (``--model
benchmarks/bench_models.py:resnet50``): ``FUNCTION(num_classes)`` returns a module."""

from __future__ import annotations

from torch import nn


def resnet50(num_classes: int) -> nn.Module:
    """torchvision's ResNet-50 as a user would take it (ImageNet stem), for 64 x 64 images."""
    from torchvision.models import resnet50 as build

    return build(num_classes=num_classes)
