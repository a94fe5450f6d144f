"""Where a submission goes, chosen one way for the CLI and the API: the user's Slurm if its tools
reach one, else the embedded local cluster (started if need be), and a line saying which.

This sits above the deployment layer: ``hpc_ddp.deploy`` takes the chosen cluster's variables
and never imports the embedded cluster itself. ``hpc_ddp.Executor`` is the deployment layer's
executor with this choice as its default.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp.deploy.spec import JobSpec
from hpc_ddp.deploy.submitit import executor as submitit_executor
from hpc_ddp.programs import register as register_programs
from hpc_ddp.slurm_client import SlurmTarget

register_programs()  # the trainer's arguments are checked through its hook (hpc_ddp/programs.py)


def choose_slurm_target(
    nodes: int = 1, gpus_per_node: int = 0, *, say: TextIO | None = sys.stdout
) -> SlurmTarget:
    """The Slurm a job of ``nodes`` x ``gpus_per_node`` goes to; prints ``Slurm: <which
    cluster>`` to ``say`` (None: silent)."""
    from hpc_ddp.localslurm.embedded import choose_slurm

    target = choose_slurm(nodes=nodes, gpus_per_node=gpus_per_node)
    if say is not None:
        print(f"Slurm: {target.description}", file=say, flush=True)
    return target


def _for_spec(spec: JobSpec) -> dict[str, str]:
    return dict(choose_slurm_target(spec.node_range[0], spec.gpus_per_node, say=sys.stderr).env)


class Executor(submitit_executor.Executor):
    __doc__ = submitit_executor.Executor.__doc__

    def __init__(
        self,
        folder: str | Path,
        cluster: submitit_executor.Cluster = "slurm",
        *,
        spec: JobSpec | None = None,
        distributed: bool = False,
        cluster_env: submitit_executor.ClusterEnv | None = None,
        **parameters: Any,
    ) -> None:
        chosen = cluster_env if cluster_env is not None else _for_spec
        super().__init__(
            folder, cluster, spec=spec, distributed=distributed, cluster_env=chosen, **parameters
        )
