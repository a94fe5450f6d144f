"""The CIFAR demo: data staging, GPU-resident and torchvision data paths, LeNet and ResNet-18.

Importing the package only registers its entries with the trainer's registry (torch-free); the
modules that need torch load when a run builds an entry.
"""

from hpc_ddp.train import registry

for _name in ("lenet", "resnet18"):
    registry.register("model", _name, f"hpc_ddp.cifar.models:{_name}")
for _name in ("cifar10", "cifar100"):
    registry.register("dataset", _name, "hpc_ddp.cifar.source:load")
