"""hpc_ddp/deploy/shell"""
