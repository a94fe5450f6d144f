"""LeNet and a CIFAR ResNet-18, both as ``nn.Sequential`` so they can be split across GPUs.

``place_model`` puts contiguous runs of the top-level stages on each of a process's devices
(naive model parallelism, no pipelining) without renaming any parameter, so checkpoints and
``params_sha256`` are the same whatever the placement.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

from hpc_ddp.errors import ConfigError


def lenet(num_classes: int) -> nn.Sequential:
    """The classic LeNet-5 for 32x32x3: conv5 6ch, pool, conv5 16ch, pool, FC 400-120-84-C."""
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Sequential(nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2)),
            conv2=nn.Sequential(nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2)),
            flatten=nn.Flatten(),
            fc1=nn.Sequential(nn.Linear(400, 120), nn.ReLU()),
            fc2=nn.Sequential(nn.Linear(120, 84), nn.ReLU()),
            fc3=nn.Linear(84, num_classes),
        )
    )


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet18(num_classes: int) -> nn.Sequential:
    """ResNet-18 for CIFAR: 3x3 stem with stride 1 and no max-pool (32x32 inputs are small)."""

    def layer(cin: int, cout: int, stride: int) -> nn.Sequential:
        return nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1))

    return nn.Sequential(
        OrderedDict(
            stem=nn.Sequential(
                nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()
            ),
            layer1=layer(64, 64, 1),
            layer2=layer(64, 128, 2),
            layer3=layer(128, 256, 2),
            layer4=layer(256, 512, 2),
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            fc=nn.Linear(512, num_classes),
        )
    )


def build_model(name: str, num_classes: int, *, sync_bn: bool = False) -> nn.Sequential:
    """A registered model (``hpc_ddp.train.registry``), SyncBatchNorm if asked for."""
    from hpc_ddp.train import registry

    model = registry.resolve("model", name)(num_classes)
    if sync_bn:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    return model


def split_points(num_stages: int, num_devices: int) -> list[int]:
    """Device index for each stage: contiguous, as even as possible (earlier devices first)."""
    if num_devices > num_stages:
        raise ConfigError(f"cannot split {num_stages} stages across {num_devices} devices")
    return [i * num_devices // num_stages for i in range(num_stages)]


def _to_device_hook(device: torch.device):
    def hook(_module: nn.Module, args: tuple) -> tuple:
        return tuple(a.to(device, non_blocking=True) if torch.is_tensor(a) else a for a in args)

    return hook


def place_model(model: nn.Sequential, devices: Sequence[torch.device]) -> nn.Sequential:
    """Put the model on one device, or split its stages across several.

    With several devices each top-level stage moves to its device and gets a forward pre-hook
    that moves its input there; the output ends on ``devices[-1]`` (see ``output_device``).
    DDP must then be built with ``device_ids=None``.
    """
    if not devices:
        raise ValueError("place_model needs at least one device")
    if len(devices) == 1:
        return model.to(devices[0])
    stages = list(model.children())
    for stage, d in zip(stages, split_points(len(stages), len(devices)), strict=True):
        stage.to(devices[d])
        stage.register_forward_pre_hook(_to_device_hook(devices[d]))
    return model


def output_device(model: nn.Module) -> torch.device:
    """Where the model's output (and so the loss) lives: the last parameter's device."""
    return list(model.parameters())[-1].device


def input_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
