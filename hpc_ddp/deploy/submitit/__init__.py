"""hpc_ddp/deploy/submitit"""
