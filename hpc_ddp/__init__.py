"""hpc-ddp: PyTorch DDP from a laptop to a Slurm cluster.

The public API (docs/api.md): every name below is importable from ``hpc_ddp``. Importing the
package never imports torch; the names that need torch load it on first use, so login nodes
without torch can still describe, render and submit jobs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> (module, attribute): resolved on first access.
_PUBLIC: dict[str, tuple[str, str]] = {
    # who am I, who are my peers (torch-free)
    "DistEnv": ("hpc_ddp.cluster", "DistEnv"),
    "detect_env": ("hpc_ddp.cluster", "detect_env"),
    # the process group (torch)
    "DistContext": ("hpc_ddp.dist", "DistContext"),
    "init_distributed": ("hpc_ddp.dist", "init_distributed"),
    "shutdown": ("hpc_ddp.dist", "shutdown_and_exit"),
    "run_main": ("hpc_ddp.dist", "run_main"),
    # training runtime (torch)
    "Checkpointer": ("hpc_ddp.checkpoint", "Checkpointer"),
    "Preemption": ("hpc_ddp.runtime.preemption", "Preemption"),
    "ShardPlan": ("hpc_ddp.runtime.sampler", "ShardPlan"),
    "ResumableDistributedSampler": ("hpc_ddp.runtime.sampler", "ResumableDistributedSampler"),
    "evaluate": ("hpc_ddp.runtime.evaluation", "evaluate"),
    "eval_indices": ("hpc_ddp.runtime.sampler", "eval_indices"),
    # jobs (torch-free)
    "JobSpec": ("hpc_ddp.deploy.spec", "JobSpec"),
    "load_job_spec": ("hpc_ddp.deploy.spec", "build_spec"),
    "render": ("hpc_ddp.deploy.sbatch.render", "render"),
    "LaunchSpec": ("hpc_ddp.deploy.shell.spec", "LaunchSpec"),
    "make_launch_spec": ("hpc_ddp.deploy.shell.spec", "make_spec"),
    "describe": ("hpc_ddp.deploy.api", "describe"),
    "submit": ("hpc_ddp.deploy.api", "submit"),
    "get_backend": ("hpc_ddp.deploy.api", "get_backend"),
    "Executor": ("hpc_ddp.deploy.submitit.executor", "Executor"),
    "Backend": ("hpc_ddp.deploy.backend", "Backend"),
    "DryRun": ("hpc_ddp.deploy.backend", "DryRun"),
    "Job": ("hpc_ddp.deploy.backend", "Job"),
    "Finished": ("hpc_ddp.deploy.backend", "Finished"),
    "RunPaths": ("hpc_ddp.runtime.run_paths", "RunPaths"),
    "ensure_local_cluster": ("hpc_ddp.localslurm.embedded", "ensure_local_cluster"),
    # errors and exit codes (torch-free)
    "HpcDdpError": ("hpc_ddp.errors", "HpcDdpError"),
    "ConfigError": ("hpc_ddp.errors", "ConfigError"),
    "EXIT_REQUEUE": ("hpc_ddp.exit_codes", "EXIT_REQUEUE"),
}

__all__ = [
    "EXIT_REQUEUE",
    "Backend",
    "Checkpointer",
    "ConfigError",
    "DistContext",
    "DistEnv",
    "DryRun",
    "Executor",
    "Finished",
    "HpcDdpError",
    "Job",
    "JobSpec",
    "LaunchSpec",
    "Preemption",
    "ResumableDistributedSampler",
    "RunPaths",
    "ShardPlan",
    "__version__",
    "describe",
    "detect_env",
    "ensure_local_cluster",
    "eval_indices",
    "evaluate",
    "get_backend",
    "init_distributed",
    "load_job_spec",
    "make_launch_spec",
    "render",
    "run_main",
    "shutdown",
    "submit",
]  # the keys of _PUBLIC (tests/test_public_api.py checks)

if TYPE_CHECKING:
    from hpc_ddp.checkpoint import Checkpointer
    from hpc_ddp.cluster import DistEnv, detect_env
    from hpc_ddp.deploy.api import describe, get_backend, submit
    from hpc_ddp.deploy.backend import Backend, DryRun, Finished, Job
    from hpc_ddp.deploy.sbatch.render import render
    from hpc_ddp.deploy.shell.spec import LaunchSpec
    from hpc_ddp.deploy.shell.spec import make_spec as make_launch_spec
    from hpc_ddp.deploy.spec import JobSpec
    from hpc_ddp.deploy.spec import build_spec as load_job_spec
    from hpc_ddp.deploy.submitit.executor import Executor
    from hpc_ddp.dist import DistContext, init_distributed, run_main
    from hpc_ddp.dist import shutdown_and_exit as shutdown
    from hpc_ddp.errors import ConfigError, HpcDdpError
    from hpc_ddp.exit_codes import EXIT_REQUEUE
    from hpc_ddp.localslurm.embedded import ensure_local_cluster
    from hpc_ddp.runtime.evaluation import evaluate
    from hpc_ddp.runtime.preemption import Preemption
    from hpc_ddp.runtime.run_paths import RunPaths
    from hpc_ddp.runtime.sampler import ResumableDistributedSampler, ShardPlan, eval_indices


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        module, attr = _PUBLIC[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
