"""hpc_ddp/deploy/sbatch"""
