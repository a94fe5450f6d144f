"""Which CUDA devices this process uses, decided without importing torch.

Visible GPUs come from CUDA_VISIBLE_DEVICES when it is set (Slurm sets it per task; with
``--gpus-per-task=1`` every task sees only device 0), else from the NVIDIA driver's
/proc/driver/nvidia/gpus directory. Ordinals are as the process sees them: 0..visible-1.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from hpc_ddp.errors import LaunchEnvError

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
        "(HPC_DDP_GPUS_PER_PROCESS)",
    )
