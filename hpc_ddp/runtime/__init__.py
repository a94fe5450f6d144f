"""hpc_ddp/runtime"""
