"""The CIFAR demo: data staging, GPU-resident and torchvision data paths, LeNet and ResNet-18.

Its entries in the trainer's registry are declared in ``entries.py`` (torch-free).
"""
