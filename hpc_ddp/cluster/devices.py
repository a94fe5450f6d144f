"""Which CUDA devices this process uses, decided without importing torch.

Visible GPUs come from CUDA_VISIBLE_DEVICES when it is set (Slurm sets it per task; with
``--gpus-per-task=1`` every task sees only device 0), else from the NVIDIA driver's
/proc/driver/nvidia/gpus directory. Ordinals are as the process sees them: 0..visible-1.

How many GPUs one process drives has one rule, :func:`resolve_gpus_per_process`, for every
place that asks (detect_env, the fork launcher, the job and launch specs). "Not given" is None
in Python; files and flags say 0, which :func:`hpc_ddp.schema.gpus_per_process_setting` turns
into None.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hpc_ddp.cluster._vars import parse_int
from hpc_ddp.env_vars import GPUS_PER_PROCESS_VAR
from hpc_ddp.errors import LaunchEnvError

DEFAULT_GPUS_PER_PROCESS = 1  # one process per GPU

_INDEX = re.compile(r"-?[0-9]{1,18}")


def parse_visible_devices(value: str) -> list[str]:
    """CUDA_VISIBLE_DEVICES entries as CUDA reads them: indices, GPU-/MIG- UUIDs.

    CUDA stops at the first invalid entry (so ``-1`` hides every GPU); Slurm writes
    ``NoDevFiles`` when a job got no GPU files.
    """
    entries: list[str] = []
    for raw in value.split(","):
        item = raw.strip()
        if not item or item == "NoDevFiles":
            break
        if _INDEX.fullmatch(item):  # not str.isdigit(): it takes '²', which int() refuses
            if int(item) < 0:
                break
        elif not item.upper().startswith(("GPU-", "MIG-")):
            break
        entries.append(item)
    return entries


def driver_gpu_count(proc_root: str = "/proc") -> int:
    """GPUs the NVIDIA driver knows (one directory per GPU), 0 without a driver."""
    try:
        return len(os.listdir(os.path.join(proc_root, "driver", "nvidia", "gpus")))
    except OSError:
        return 0


def has_nvidia_driver(proc_root: str = "/proc") -> bool:
    return os.path.isdir(os.path.join(proc_root, "driver", "nvidia"))


def count_visible_gpus(environ: Mapping[str, str], proc_root: str = "/proc") -> int:
    if "CUDA_VISIBLE_DEVICES" in environ:
        return len(parse_visible_devices(environ["CUDA_VISIBLE_DEVICES"]))
    return driver_gpu_count(proc_root)


def assign_gpus(
    *, local_rank: int, local_world_size: int, gpus_per_process: int, visible: int
) -> tuple[int, ...]:
    """Rules: none visible -> CPU; exactly gpus_per_process visible -> all of them (Slurm
    restricted this task already); enough for every local process -> this process's slice;
    otherwise an error, since two processes sharing a GPU is almost always a mistake."""
    if visible <= 0:
        return ()
    if visible == gpus_per_process:
        return tuple(range(visible))
    needed = local_world_size * gpus_per_process
    if visible >= needed:
        first = local_rank * gpus_per_process
        return tuple(range(first, first + gpus_per_process))
    raise LaunchEnvError(
        f"more local processes than visible GPUs: {local_world_size} process(es) on this node x "
        f"{gpus_per_process} GPU(s) each need {needed}, but this process sees {visible}",
        hint="ask for one GPU per process (sbatch --gpus-per-node=N with --ntasks-per-node=N, "
        "or --gpus-per-task), start fewer processes per node, or lower gpus_per_process "
        f"({GPUS_PER_PROCESS_VAR})",
    )


def resolve_gpus_per_process(requested: int | None, environ: Mapping[str, str]) -> int:
    """GPUs per process: ``requested`` if given (at least 1), else the GPUS_PER_PROCESS_VAR of
    ``environ`` (the environment the processes run with), else 1. A value given that
    contradicts the variable is an error: one of the two was left over from another layout."""
    from_env = environ.get(GPUS_PER_PROCESS_VAR)
    env_value = parse_int(from_env, GPUS_PER_PROCESS_VAR, minimum=1) if from_env else None
    if requested is None:
        return env_value or DEFAULT_GPUS_PER_PROCESS
    if requested < 1:
        raise LaunchEnvError(
            f"gpus_per_process={requested} must be at least 1",
            hint="1 = one process per GPU; G = one process drives G GPUs; None = not given",
        )
    if env_value is not None and env_value != requested:
        raise LaunchEnvError(
            f"gpus_per_process={requested} was asked for but {GPUS_PER_PROCESS_VAR}={env_value} "
            "says otherwise",
            hint=f"make them agree, or drop one (unset {GPUS_PER_PROCESS_VAR})",
        )
    return requested
