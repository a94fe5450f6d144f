"""The state of FSDP2 (``fully_shard``) models and their optimizers, as ``Resumable`` saves it.

A model sharded with ``fully_shard`` holds DTensors: each rank owns a shard of every parameter,
and so of the optimizer's state. Its state is saved through ``torch.distributed.checkpoint``
(the checkpoint's ``dcp/`` payload, :mod:`hpc_ddp.checkpoint.sharded`): every rank writes its
shards, and a load reads them into the live sharded state, resharded to the world that loads
it. The state dicts come from ``torch.distributed.checkpoint.state_dict`` (keyed by parameter
names, not optimizer indices, which is what makes resharding possible); objects that are not
sharded (schedulers, scalers, a loop's counters) are saved beside them, each as one opaque value
(:func:`opaque`): DCP loads only the keys of the state it loads into, flattened, so a nested
value whose shape changes as training goes on (a list that grows, an entry that starts as None)
would not load into a fresh object's state.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from hpc_ddp.checkpoint.errors import CheckpointError
from hpc_ddp.errors import ConfigError


def _params(obj: Any) -> list[Any]:
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    if isinstance(obj, torch.optim.Optimizer):
        return [p for group in obj.param_groups for p in group["params"]]
    return []


def opaque(state: Any) -> bytes:
    """A state dict of an object that is not sharded, as one value DCP stores whole."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def from_opaque(value: Any, name: str) -> Any:
    """:func:`opaque`'s state back; read as data (``weights_only``), never run as code."""
    problem = f"is a {type(value).__name__}"
    if isinstance(value, bytes):
        try:
            return torch.load(io.BytesIO(value), weights_only=True)
        except Exception as exc:  # unpickling refused or failed: the value is not ours
            problem = f"cannot be read as a state dict ({type(exc).__name__})"
    raise CheckpointError(
        f"the sharded checkpoint's {name!r} {problem}, not a state saved by hpc_ddp.Resumable",
        hint="move that checkpoint aside (the run then resumes from the one before it), or "
        "start a new run directory",
    )


class ShardedState:
    """``objects`` (name -> model, optimizer, scheduler, ...) saved and restored through DCP.

    Each optimizer is paired with the model whose parameters it steps (DCP's optimizer state
    dict is keyed by that model's parameter names).
    """

    def __init__(self, objects: dict[str, Any]) -> None:
        self.objects = objects
        models = [m for m in objects.values() if isinstance(m, nn.Module)]
        self.owner: dict[str, nn.Module] = {}
        for name, obj in objects.items():
            if not isinstance(obj, torch.optim.Optimizer):
                continue
            ids = {id(p) for p in _params(obj)}
            owner = next((m for m in models if ids <= {id(p) for p in m.parameters()}), None)
            if owner is None:
                raise ConfigError(
                    f"Resumable({name}=...): its parameters are not all of one model passed to "
                    "Resumable",
                    hint="pass the fully_shard model too (model=...), and build the optimizer "
                    "from its parameters() after fully_shard",
                )
            self.owner[name] = owner

    def state_dict(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """Every object's state (or only the ``names`` objects'); sharded tensors stay DTensors
        (no rank gathers the whole)."""
        out: dict[str, Any] = {}
        for name in self.objects if names is None else names:
            obj = self.objects[name]
            if isinstance(obj, nn.Module):
                out[name] = get_model_state_dict(obj)
            elif name in self.owner:
                out[name] = get_optimizer_state_dict(self.owner[name], obj)
            else:
                out[name] = opaque(obj.state_dict())
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put ``state`` (:meth:`state_dict`'s layout, read back in place) into the objects."""
        for name, obj in self.objects.items():
            if isinstance(obj, nn.Module):
                set_model_state_dict(obj, state[name])
            elif name in self.owner:
                set_optimizer_state_dict(self.owner[name], obj, state[name])
            else:
                obj.load_state_dict(from_opaque(state[name], name))
