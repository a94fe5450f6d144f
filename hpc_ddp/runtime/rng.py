"""Capture and restore every RNG a training process uses: Python, NumPy, torch CPU, CUDA.

States are stored as tensors, ints and lists only, so a checkpoint loads with
``torch.load(weights_only=True)`` (NumPy arrays and arbitrary tuples would not).
"""

from __future__ import annotations

import hashlib
import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators (every CUDA device's too) with ``seed``:
    the same seed on every rank builds identical initial weights."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def use_deterministic_kernels() -> None:
    """Kernels whose results do not depend on scheduling (cuDNN's non-atomic algorithms, cuBLAS
    with a fixed workspace): GPU runs repeat bit for bit. Call before the first cuBLAS use."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    # warn_only: an op without a deterministic kernel warns instead of stopping the run.
    torch.use_deterministic_algorithms(True, warn_only=True)


def capture() -> dict[str, Any]:
    """This process's RNG states (Python, NumPy, torch CPU, every initialised CUDA device), as
    plain data for a checkpoint's ``per_rank`` part: each rank has its own streams (dropout,
    augmentation), and an exact resume needs every one of them back."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        # One int64 tensor, not a list of 625 ints: a background save pickles and checks it per
        # object, holding the interpreter lock the training thread needs.
        "python": {"version": version, "state": torch.tensor(internal), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back the states :func:`capture` returned (CUDA ones only for devices that exist)."""
    py = state["python"]
    internal = py["state"]  # a list in checkpoints written before it became a tensor
    values = internal.tolist() if isinstance(internal, torch.Tensor) else internal
    random.setstate((py["version"], tuple(values), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            npst["kind"],
            npst["keys"].numpy().astype(np.uint32),
            npst["pos"],
            npst["has_gauss"],
            npst["cached"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = state["cuda"]
        # A process may now see a different number of GPUs: restore those that exist.
        for i, s in enumerate(cuda_states[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def derived_seed(seed: int, step: int, rank: int, stream: str = "process") -> int:
    """The seed of ``rank``'s ``stream`` when a run resumes at ``step`` on another number of
    ranks: the saved streams belong to the old ranks (some of which are gone, or new), so each
    rank's are derived afresh from what all ranks know. The first 8 bytes of
    sha256("hpc-ddp/{stream}/{seed}/{step}/{rank}"): independent of the old world size, different
    for every rank and every resume, the same on every attempt that resumes there."""
    text = f"hpc-ddp/{stream}/{seed}/{step}/{rank}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "big") >> 1  # 63 bits: any RNG's seed


def reseed(seed: int, step: int, rank: int) -> None:
    """Seed every RNG of this process (``seed_everything``) with :func:`derived_seed`."""
    seed_everything(derived_seed(seed, step, rank))
