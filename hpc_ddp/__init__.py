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
    "torch_contract": ("hpc_ddp.cluster", "torch_contract"),
    # the process group (torch)
    "DistContext": ("hpc_ddp.dist", "DistContext"),
    "init_distributed": ("hpc_ddp.dist", "init_distributed"),
    "shutdown": ("hpc_ddp.dist", "shutdown_and_exit"),
    "run_main": ("hpc_ddp.dist", "run_main"),
    "exit_code_of": ("hpc_ddp.dist", "exit_code_of"),
    "end_process_group": ("hpc_ddp.dist", "end_process_group"),
    "process_device": ("hpc_ddp.dist", "process_device"),
    "pick_backend": ("hpc_ddp.network", "pick_backend"),
    "spawn_workers": ("hpc_ddp.spawn", "launch"),
    "usable_cores": ("hpc_ddp.spawn", "usable_cores"),
    "die_with_parent": ("hpc_ddp.spawn", "die_with_parent"),
    # the trainer (torch once it trains; a finished run is answered without it)
    "run_training": ("hpc_ddp.train.cli", "run_training"),
    # training runtime (torch)
    "Resumable": ("hpc_ddp.runtime.resumable", "Resumable"),
    "Checkpointer": ("hpc_ddp.checkpoint", "Checkpointer"),
    "Preemption": ("hpc_ddp.runtime.preemption", "Preemption"),
    "parse_signal": ("hpc_ddp.runtime.preemption", "parse_signal"),
    "requeue": ("hpc_ddp.runtime.preemption", "requeue"),
    "Comm": ("hpc_ddp.runtime.collectives", "Comm"),
    "ShardPlan": ("hpc_ddp.runtime.shard_plan", "ShardPlan"),
    "ResumableDistributedSampler": ("hpc_ddp.runtime.sampler", "ResumableDistributedSampler"),
    "evaluate": ("hpc_ddp.runtime.evaluation", "evaluate"),
    "EvalSums": ("hpc_ddp.runtime.evaluation", "EvalSums"),
    "eval_sums": ("hpc_ddp.runtime.evaluation", "accumulate"),
    "eval_indices": ("hpc_ddp.runtime.shard_plan", "eval_indices"),
    "per_tensor_allreduce": ("hpc_ddp.runtime.exact_allreduce", "per_tensor_allreduce"),
    "per_tensor_comm_hook": ("hpc_ddp.runtime.exact_allreduce", "per_tensor_comm_hook"),
    "average_each": ("hpc_ddp.runtime.exact_allreduce", "average_each"),
    "capture_rng_state": ("hpc_ddp.runtime.rng", "capture"),
    "restore_rng_state": ("hpc_ddp.runtime.rng", "restore"),
    "seed_everything": ("hpc_ddp.runtime.rng", "seed_everything"),
    "use_deterministic_kernels": ("hpc_ddp.runtime.rng", "use_deterministic_kernels"),
    "params_sha256": ("hpc_ddp.train.fingerprint", "params_sha256"),
    "speed_up": ("hpc_ddp.runtime.fast_step", "speed_up"),
    "SpeedUp": ("hpc_ddp.runtime.fast_step", "SpeedUp"),
    "CapturedStep": ("hpc_ddp.runtime.captured_step", "CapturedStep"),
    # jobs (torch-free)
    "JobSpec": ("hpc_ddp.deploy.spec", "JobSpec"),
    "load_job_spec": ("hpc_ddp.deploy.spec", "build_spec"),
    "render": ("hpc_ddp.deploy.sbatch.render", "render"),
    "LaunchSpec": ("hpc_ddp.deploy.shell.spec", "LaunchSpec"),
    "make_launch_spec": ("hpc_ddp.deploy.shell.spec", "make_spec"),
    "stop_launch": ("hpc_ddp.deploy.shell.runner", "stop_all"),
    "describe": ("hpc_ddp.deploy.api", "describe"),
    "submit": ("hpc_ddp.deploy.api", "submit"),
    "get_backend": ("hpc_ddp.deploy.api", "get_backend"),
    "Executor": ("hpc_ddp.submission", "Executor"),
    "Backend": ("hpc_ddp.deploy.backend", "Backend"),
    "DryRun": ("hpc_ddp.deploy.backend", "DryRun"),
    "Job": ("hpc_ddp.deploy.backend", "Job"),
    "Finished": ("hpc_ddp.deploy.backend", "Finished"),
    "ProgramHook": ("hpc_ddp.deploy.program", "ProgramHook"),
    "ProgramFlags": ("hpc_ddp.deploy.program", "ProgramFlags"),
    "JobNeeds": ("hpc_ddp.deploy.program", "JobNeeds"),
    "RunPaths": ("hpc_ddp.run_dir", "RunPaths"),
    # job control after submission (torch-free)
    "attach_job": ("hpc_ddp.deploy.job_control", "attach_job"),
    "job_report": ("hpc_ddp.deploy.job_control", "job_report"),
    "JobReport": ("hpc_ddp.deploy.job_control", "JobReport"),
    "log_paths": ("hpc_ddp.deploy.job_control", "log_paths"),
    "follow_logs": ("hpc_ddp.deploy.job_control", "follow_logs"),
    "cancel_job": ("hpc_ddp.deploy.job_control", "cancel_job"),
    "run_dir_report": ("hpc_ddp.deploy.job_control", "run_dir_report"),
    # checks of a node or allocation, and of a hang after the fact (torch-free)
    "doctor": ("hpc_ddp.doctor_checks", "doctor"),
    "Check": ("hpc_ddp.doctor_checks", "Check"),
    "nccl_dump_report": ("hpc_ddp.deploy.flight_recorder", "report"),
    "ensure_local_cluster": ("hpc_ddp.localslurm.embedded", "ensure_local_cluster"),
    # the embedded local Slurm cluster: `hpc-ddp cluster up|down|status|env` (torch-free)
    "cluster_up": ("hpc_ddp.localslurm.lifecycle", "cluster_up"),
    "cluster_down": ("hpc_ddp.localslurm.lifecycle", "cluster_down"),
    "running_cluster": ("hpc_ddp.localslurm.lifecycle", "running_cluster"),
    "cluster_env": ("hpc_ddp.localslurm.lifecycle", "cluster_env"),
    "ClusterUp": ("hpc_ddp.localslurm.lifecycle", "ClusterUp"),
    "LocalCluster": ("hpc_ddp.localslurm.daemons", "LocalCluster"),
    # errors and exit codes (torch-free)
    "HpcDdpError": ("hpc_ddp.errors", "HpcDdpError"),
    "ConfigError": ("hpc_ddp.errors", "ConfigError"),
    "EXIT_REQUEUE": ("hpc_ddp.exit_codes", "EXIT_REQUEUE"),
    "EXIT_DIVERGED": ("hpc_ddp.exit_codes", "EXIT_DIVERGED"),
}

__all__ = [
    "EXIT_DIVERGED",
    "EXIT_REQUEUE",
    "Backend",
    "CapturedStep",
    "Check",
    "Checkpointer",
    "ClusterUp",
    "Comm",
    "ConfigError",
    "DistContext",
    "DistEnv",
    "DryRun",
    "EvalSums",
    "Executor",
    "Finished",
    "HpcDdpError",
    "Job",
    "JobNeeds",
    "JobReport",
    "JobSpec",
    "LaunchSpec",
    "LocalCluster",
    "Preemption",
    "ProgramFlags",
    "ProgramHook",
    "Resumable",
    "ResumableDistributedSampler",
    "RunPaths",
    "ShardPlan",
    "SpeedUp",
    "__version__",
    "attach_job",
    "average_each",
    "cancel_job",
    "capture_rng_state",
    "cluster_down",
    "cluster_env",
    "cluster_up",
    "describe",
    "detect_env",
    "die_with_parent",
    "doctor",
    "end_process_group",
    "ensure_local_cluster",
    "eval_indices",
    "eval_sums",
    "evaluate",
    "exit_code_of",
    "follow_logs",
    "get_backend",
    "init_distributed",
    "job_report",
    "load_job_spec",
    "log_paths",
    "make_launch_spec",
    "nccl_dump_report",
    "params_sha256",
    "parse_signal",
    "per_tensor_allreduce",
    "per_tensor_comm_hook",
    "pick_backend",
    "process_device",
    "render",
    "requeue",
    "restore_rng_state",
    "run_dir_report",
    "run_main",
    "run_training",
    "running_cluster",
    "seed_everything",
    "shutdown",
    "spawn_workers",
    "speed_up",
    "stop_launch",
    "submit",
    "torch_contract",
    "usable_cores",
    "use_deterministic_kernels",
]  # the keys of _PUBLIC (tests/test_public_api.py checks)

if TYPE_CHECKING:
    from hpc_ddp.checkpoint import Checkpointer
    from hpc_ddp.cluster import DistEnv, detect_env, torch_contract
    from hpc_ddp.deploy.api import describe, get_backend, submit
    from hpc_ddp.deploy.backend import Backend, DryRun, Finished, Job
    from hpc_ddp.deploy.flight_recorder import report as nccl_dump_report
    from hpc_ddp.deploy.job_control import (
        JobReport,
        attach_job,
        cancel_job,
        follow_logs,
        job_report,
        log_paths,
        run_dir_report,
    )
    from hpc_ddp.deploy.program import JobNeeds, ProgramFlags, ProgramHook
    from hpc_ddp.deploy.sbatch.render import render
    from hpc_ddp.deploy.shell.runner import stop_all as stop_launch
    from hpc_ddp.deploy.shell.spec import LaunchSpec
    from hpc_ddp.deploy.shell.spec import make_spec as make_launch_spec
    from hpc_ddp.deploy.spec import JobSpec
    from hpc_ddp.deploy.spec import build_spec as load_job_spec
    from hpc_ddp.dist import (
        DistContext,
        end_process_group,
        exit_code_of,
        init_distributed,
        process_device,
        run_main,
    )
    from hpc_ddp.dist import shutdown_and_exit as shutdown
    from hpc_ddp.doctor_checks import Check, doctor
    from hpc_ddp.errors import ConfigError, HpcDdpError
    from hpc_ddp.exit_codes import EXIT_DIVERGED, EXIT_REQUEUE
    from hpc_ddp.localslurm.daemons import LocalCluster
    from hpc_ddp.localslurm.embedded import ensure_local_cluster
    from hpc_ddp.localslurm.lifecycle import (
        ClusterUp,
        cluster_down,
        cluster_env,
        cluster_up,
        running_cluster,
    )
    from hpc_ddp.network import pick_backend
    from hpc_ddp.run_dir import RunPaths
    from hpc_ddp.runtime.captured_step import CapturedStep
    from hpc_ddp.runtime.collectives import Comm
    from hpc_ddp.runtime.evaluation import EvalSums, evaluate
    from hpc_ddp.runtime.evaluation import accumulate as eval_sums
    from hpc_ddp.runtime.exact_allreduce import (
        average_each,
        per_tensor_allreduce,
        per_tensor_comm_hook,
    )
    from hpc_ddp.runtime.fast_step import SpeedUp, speed_up
    from hpc_ddp.runtime.preemption import Preemption, parse_signal, requeue
    from hpc_ddp.runtime.resumable import Resumable
    from hpc_ddp.runtime.rng import capture as capture_rng_state
    from hpc_ddp.runtime.rng import restore as restore_rng_state
    from hpc_ddp.runtime.rng import seed_everything, use_deterministic_kernels
    from hpc_ddp.runtime.sampler import ResumableDistributedSampler
    from hpc_ddp.runtime.shard_plan import ShardPlan, eval_indices
    from hpc_ddp.spawn import die_with_parent, usable_cores
    from hpc_ddp.spawn import launch as spawn_workers
    from hpc_ddp.submission import Executor
    from hpc_ddp.train.cli import run_training
    from hpc_ddp.train.fingerprint import params_sha256


# The modules of the names that describe, submit or inspect jobs: their deployment layer asks a
# job's program about its arguments through the program's hook, so the trainer's is registered
# first (hpc_ddp/programs.py).
_JOB_MODULES = ("hpc_ddp.deploy.", "hpc_ddp.doctor_checks", "hpc_ddp.submission")


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        module, attr = _PUBLIC[name]
        if module.startswith(_JOB_MODULES):
            from hpc_ddp import programs

            programs.register()
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # later accesses skip this function
        return value
    raise AttributeError(f"module 'hpc_ddp' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
