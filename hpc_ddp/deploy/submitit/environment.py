"""The environment every submitit task sets up before its work runs, whatever that work is (a
function, the trainer, a script): the spec's variables, then the ones
``init_process_group(init_method="env://")`` reads (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...),
worked out by ``hpc_ddp.detect_env`` from what submitit's launcher set (Slurm's ``SLURM_*`` or the
LocalExecutor's ``SUBMITIT_LOCAL_*``). A program started as a child inherits them, as a torchrun
worker would: a script that calls ``init_process_group`` itself needs nothing else.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hpc_ddp.cluster import DistEnv, detect_env, torch_contract


def export_task_env(env: Mapping[str, str]) -> DistEnv:
    """Export ``env`` (the spec's), then this task's rank, world and master; returns them."""
    os.environ.update(env)
    os.environ.update(torch_contract())
    return detect_env()
