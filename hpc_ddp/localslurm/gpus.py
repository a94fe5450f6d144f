"""Real GPUs for the local cluster's gres.conf: which device files, and which node gets which.

Debian's Slurm 22.05 is built without NVML (no gpu_nvml.so), so ``AutoDetect=nvml`` is not
available: the device files are named in gres.conf. slurmd reads each file's major/minor
numbers (a device cgroup, when cgroups are on, allows exactly those) and gives every task the
indexes of its GPUs in CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import re
import stat
from collections.abc import Sequence
from pathlib import Path

from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm.install import checked_path

# The NVIDIA driver's per-GPU nodes: /dev/nvidia0, /dev/nvidia1, ... (not nvidiactl, nvidia-uvm).
_NVIDIA_GPU = re.compile(r"nvidia(\d+)")
AUTO = "auto"


def nvidia_devices(dev: Path = Path("/dev")) -> tuple[str, ...]:
    """This machine's /dev/nvidiaN character devices, in N order."""
    found = []
    for path in dev.glob("nvidia*"):
        m = _NVIDIA_GPU.fullmatch(path.name)
        if m and _is_char_device(path):
            found.append((int(m.group(1)), str(path)))
    return tuple(path for _, path in sorted(found))


def parse_devices(value: str, dev: Path = Path("/dev")) -> tuple[str, ...]:
    """``auto`` (every /dev/nvidiaN here) or a comma-separated list of device files."""
    if value == AUTO:
        found = nvidia_devices(dev)
        if not found:
            raise ConfigError(
                f"--gpu-devices auto: no /dev/nvidiaN devices on this machine ({dev})",
                hint="is the NVIDIA driver loaded (nvidia-smi -L)? Or name the files: "
                "--gpu-devices /dev/nvidia0,/dev/nvidia1",
            )
        return found
    paths = tuple(checked_path(p, "GPU device") for p in value.split(","))
    if len(set(paths)) != len(paths):
        raise ConfigError(f"--gpu-devices {value!r} names a device twice")
    return paths


def check_devices(paths: Sequence[str]) -> None:
    """Each file exists and is a character device (slurmd refuses anything else)."""
    bad = [p for p in paths if not _is_char_device(Path(p))]
    if bad:
        raise ConfigError(
            f"GPU device file(s) {', '.join(bad)} missing or not character devices",
            hint="list the GPUs' device files (ls -l /dev/nvidia*), or use --gpu-devices auto",
        )


def per_node(paths: Sequence[str], nodes: int) -> list[tuple[str, ...]]:
    """The devices split into ``nodes`` equal consecutive shares: node1 the first, and so on."""
    if not paths or len(paths) % nodes:
        raise ConfigError(
            f"{len(paths)} GPU device(s) cannot be shared equally by {nodes} node(s)",
            hint="use a number of nodes that divides the number of GPUs",
        )
    share = len(paths) // nodes
    return [tuple(paths[i * share : (i + 1) * share]) for i in range(nodes)]


def _is_char_device(path: Path) -> bool:
    try:
        return stat.S_ISCHR(path.stat().st_mode)
    except OSError:
        return False
