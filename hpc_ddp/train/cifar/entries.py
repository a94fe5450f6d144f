"""The CIFAR demo's entries in the trainer's registry (hpc_ddp.train.registry loads them).

Plain data, no imports: the registry, and so config validation, stay torch-free and free of
import cycles. A model target is ``f(num_classes) -> nn.Module``, a dataset target
``f(cfg, ctx, comm) -> data_source.Splits``.
"""

MODELS = {
    "lenet": "hpc_ddp.train.cifar.models:lenet",
    "resnet18": "hpc_ddp.train.cifar.models:resnet18",
}
DATASETS = {
    "cifar10": "hpc_ddp.train.cifar.source:load",
    "cifar100": "hpc_ddp.train.cifar.source:load",
    # Not CIFAR: folders of encoded images from disk (train/image_folder_splits.py).
    "imagefolder": "hpc_ddp.train.image_folder_splits:load",
}
