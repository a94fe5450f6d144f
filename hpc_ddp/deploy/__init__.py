"""Describe a job (``JobSpec``), render it to sbatch (``render``), submit it (sbatch or submitit).

Never imports torch: rendering a job must take well under a second.
"""

from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.spec import JobSpec, build_spec, load_spec_file

__all__ = ["JobSpec", "build_spec", "load_spec_file", "render"]
