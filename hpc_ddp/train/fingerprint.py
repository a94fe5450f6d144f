"""A short fingerprint of a model's weights, to prove two runs ended with identical weights."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from hpc_ddp.dtensors import dtensor_type

_DDP_PREFIX = "module."


def params_sha256(state_dict: Mapping[str, torch.Tensor]) -> str:
    """sha256 over every tensor of a state dict, in name order, as raw bytes on the CPU.

    Names lose DDP's ``module.`` prefix so a DDP model and its bare module agree; dtype and
    shape are hashed too, so a float16 copy of the same numbers is a different fingerprint.
    Non-tensor entries (rare; extra state) are ignored. Bit-exact: 0.0 and -0.0 differ.

    A sharded model's (FSDP2: DTensors) tensors are gathered whole, one at a time, so its
    fingerprint is its full weights', comparable with a DDP run's: every rank must call it then
    (the gathers are collectives), and every rank gets the same answer.
    """
    h = hashlib.sha256()
    items = {
        (k[len(_DDP_PREFIX) :] if k.startswith(_DDP_PREFIX) else k): v
        for k, v in state_dict.items()
        if isinstance(v, torch.Tensor)
    }
    for name in sorted(items):
        t = _whole(items[name].detach()).to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        # Reinterpret as bytes: works for every dtype (bfloat16 has no numpy equivalent).
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); any other tensor as it is."""
    dtensor = dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        return t.full_tensor()
    return t
