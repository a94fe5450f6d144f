"""What may go into a checkpoint, and the one rewrite applied to it.

A checkpoint is data, never code: it is read back with ``torch.load(weights_only=True)``, which
only rebuilds tensors and plain containers. Checking the same rule at save time turns "resume
fails three days later" into "save fails now, naming the offending key".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch

from .errors import UnsafeCheckpointContentError

# Leaves that weights_only=True rebuilds without running any code from the file.
_PLAIN_LEAVES = (bool, int, float, complex, str, bytes, type(None))
_TORCH_LEAVES = (torch.Tensor, torch.Size, torch.dtype, torch.device)
DDP_PREFIX = "module."


def check_plain(obj: Any, where: str = "state") -> None:
    """Raise UnsafeCheckpointContentError at the first value weights_only=True would refuse."""
    if isinstance(obj, (_TORCH_LEAVES, _PLAIN_LEAVES)):
        if isinstance(obj, torch.Tensor) and type(obj) not in (torch.Tensor, torch.nn.Parameter):
            # Tensor subclasses (DTensor, custom) pickle their class: convert to plain tensors.
            _refuse(obj, where)
        return
    if isinstance(obj, (dict, OrderedDict)):
        for key, value in obj.items():
            if not isinstance(key, _PLAIN_LEAVES):
                _refuse(key, f"{where} (a key)")
            check_plain(value, f"{where}[{key!r}]")
        return
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        for i, value in enumerate(obj):
            check_plain(value, f"{where}[{i}]")
        return
    _refuse(obj, where)


def _refuse(obj: Any, where: str) -> None:
    kind = f"{type(obj).__module__}.{type(obj).__qualname__}"
    hint = "store plain data: tensors, dicts, lists, tuples, ints, floats, strings, None"
    if kind.startswith("numpy."):
        hint = (
            "convert numpy values first (torch.from_numpy(a) for arrays, .item() for scalars); "
            "for RNG states use hpc_ddp.runtime.rng.capture()"
        )
    raise UnsafeCheckpointContentError(
        f"cannot checkpoint {where}: it is a {kind}, which torch.load(weights_only=True) "
        "refuses to rebuild (a checkpoint is data, never code)",
        hint=hint,
    )


def strip_ddp_prefix(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Drop DistributedDataParallel's ``module.`` key prefix so the checkpoint loads into the
    bare model, with or without DDP, on any world size."""
    out: dict[str, Any] = OrderedDict()
    for key, value in state_dict.items():
        out[key[len(DDP_PREFIX) :] if key.startswith(DDP_PREFIX) else key] = value
    return out


def prepare_shared(shared: Mapping[str, Any]) -> dict[str, Any]:
    """The shared part as written: ``model`` without the DDP prefix, everything checked."""
    out = dict(shared)
    model = out.get("model")
    if isinstance(model, Mapping):
        out["model"] = strip_ddp_prefix(model)
    check_plain(out, "shared")
    return out
