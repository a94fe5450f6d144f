"""hpc-ddp: PyTorch DDP from a laptop to a Slurm cluster.

Importing this package (or ``hpc_ddp.cluster``, ``hpc_ddp.network``, ``hpc_ddp.deploy``) never
imports torch: commands that do not train must answer in well under a second.
"""

__version__ = "0.1.0"
