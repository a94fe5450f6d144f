"""hpc_ddp/cifar"""
