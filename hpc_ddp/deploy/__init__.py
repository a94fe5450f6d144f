"""Describe a job and run it, with one interface for every backend (docs/architecture.md).

``JobSpec`` (sbatch, submitit) and ``LaunchSpec`` (pdsh/clush) share one core, ``ProcessSpec``.
A backend's ``describe`` gives the script (``render`` is the sbatch one), its ``submit`` a ``Job``
to ask, wait for and cancel; ``hpc_ddp.submit`` / ``hpc_ddp.describe`` pick the backend.
Never imports torch: describing a job must take well under a second.
"""

from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.spec import JobSpec, build_spec, load_spec_file

__all__ = ["JobSpec", "build_spec", "load_spec_file", "render"]
