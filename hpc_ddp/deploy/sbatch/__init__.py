"""The sbatch backend: a JobSpec rendered to a batch script (``render``), submitted with real
sbatch and followed through ``scontrol`` (``SbatchBackend``)."""

from hpc_ddp.deploy.sbatch.render import render

__all__ = ["render"]
