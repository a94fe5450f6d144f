"""Create this process's CUDA contexts on a thread while the main thread imports torch.

On the GPU machines a CUDA context took 0.4-0.8 s to create and ``import torch`` 3-4 s, and
torch creates the context only after its import (benchmarks/NOTES.md). The context torch uses
is the driver's *primary* context of each device; retaining it first through the driver API,
on a thread, hides its creation behind the import: ctypes lets go of the interpreter during
each driver call, and torch later finds the context ready.

Only in a process that will use the GPUs itself, never in one that forks workers afterwards
(a forked child cannot use its parent's context). Set HPC_DDP_EARLY_CUDA=0 to turn it off.
Any failure here is only recorded: torch then creates the context itself and reports errors.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from hpc_ddp.cluster import detect_env
from hpc_ddp.cluster.devices import count_visible_gpus, has_nvidia_driver
from hpc_ddp.errors import HpcDdpError

SWITCH = "HPC_DDP_EARLY_CUDA"
WAIT_S = 120.0  # a driver that takes longer is stuck; torch would be stuck in it too


def wanted(environ: Mapping[str, str] | None = None, proc_root: str = "/proc") -> bool:
    """Whether this machine's workers would use GPUs and the switch is not off."""
    environ = os.environ if environ is None else environ
    return (
        environ.get(SWITCH, "1") != "0"
        and has_nvidia_driver(proc_root)
        and count_visible_gpus(environ, proc_root) > 0
    )


@dataclass
class EarlyContexts:
    """The thread retaining the primary contexts of ``devices``; ``wait`` before torch uses CUDA."""

    devices: tuple[int, ...]
    started: float = field(default_factory=time.time)
    finished: float | None = None
    error: str | None = None
    handles: list[int] = field(default_factory=list)  # CUcontext of each device, as retained
    _thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            self.handles = _retain_primary_contexts(self.devices)
        except (OSError, RuntimeError) as err:
            self.error = str(err)
        self.finished = time.time()

    def wait(self) -> None:
        if self._thread is None:
            return
        self._thread.join(WAIT_S)
        if self._thread.is_alive():
            print(
                f"hpc-ddp: warning: creating the CUDA context of device(s) {list(self.devices)} "
                f"took over {WAIT_S:.0f} s; carrying on (torch will wait for the driver)",
                file=sys.stderr,
                flush=True,
            )

    @property
    def seconds(self) -> float | None:
        return None if self.finished is None else self.finished - self.started


def start(gpus_per_process: int | None = None) -> EarlyContexts | None:
    """Start creating the contexts of this process's GPUs; None when there is nothing to gain:
    no GPUs, the switch is off, or torch is imported already."""
    if "torch" in sys.modules or not wanted():
        return None
    try:
        devices = detect_env(gpus_per_process=gpus_per_process).gpus
    except HpcDdpError:
        return None  # the trainer reads the environment again and reports what is wrong
    if not devices:
        return None
    # What torch sets before its own cuInit when the user has not chosen: the driver reads it
    # once, at cuInit, so it must be in place before ours.
    os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
    contexts = EarlyContexts(tuple(devices))
    contexts._thread = threading.Thread(target=contexts.run, name="early-cuda", daemon=True)
    contexts._thread.start()
    return contexts


def _retain_primary_contexts(devices: Sequence[int]) -> list[int]:
    """cuInit, then cuDevicePrimaryCtxRetain for each device (ordinals as this process sees
    them under CUDA_VISIBLE_DEVICES, as torch numbers them)."""
    libcuda = ctypes.CDLL("libcuda.so.1")

    def check(what: str, result: int) -> None:
        if result != 0:
            raise RuntimeError(f"{what} returned CUDA error {result}")

    check("cuInit", libcuda.cuInit(0))
    handles = []
    for ordinal in devices:
        device = ctypes.c_int()
        check(f"cuDeviceGet({ordinal})", libcuda.cuDeviceGet(ctypes.byref(device), ordinal))
        context = ctypes.c_void_p()
        check(
            f"cuDevicePrimaryCtxRetain({ordinal})",
            libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device),
        )
        handles.append(context.value or 0)
    return handles
