"""The optimizer as a CUDA graph can replay it, and saved as if it never had been.

A graph replays the kernels it recorded with the values they read then: a Python float (the
learning rate) is baked in, so an LR scheduler would change nothing. Adam's ``capturable`` mode
and SGD's fused kernel read the learning rate from a 1-element device tensor instead, which a
scheduler fills in place. That tensor, and the flags set for it, are how this process steps, not
what it learnt: ``saved_as_given`` writes a checkpoint with the float and the flags the optimizer
was built with, so it loads into a script that steps eagerly (and back: ``make_capturable`` runs
again after a load).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from hpc_ddp.env_vars import GRAPH_FUSED_ADAM_VAR
from hpc_ddp.errors import ConfigError
from hpc_ddp.runtime.fast_step import lay_out_state

# The flags make_capturable may change; a checkpoint gets the values they had before.
FLAGS = ("capturable", "fused", "foreach")
# The optimizers whose captured step is tested: Adam's capturable mode (AdamW is an Adam) and
# SGD's fused kernel, each reading a tensor learning rate on the GPU.
CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def why_not_capturable(optimizer: torch.optim.Optimizer) -> str | None:
    """Why a graph cannot replay ``optimizer``'s step, or None if it can."""
    name = type(optimizer).__name__
    if not isinstance(optimizer, CAPTURABLE):
        return f"{name} has no capturable kernel here (SGD, Adam and AdamW have)"
    if any(group.get("differentiable") for group in optimizer.param_groups):
        return f"{name}(differentiable=True) has no capturable kernel"
    return None


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Adam's capturable mode or SGD's fused kernel, a device-tensor LR, and any loaded state
    on its parameter's device, laid out as its parameter (``fast_step.lay_out_state``).

    On CUDA Adam also takes its fused kernel (one launch instead of a dozen multi-tensor ones): the
    same algorithm in less GPU time per captured step (benchmarks/NOTES.md).
    ``env_vars.GRAPH_FUSED_ADAM_VAR`` set to 0 keeps the multi-tensor kernels. SGD has no such
    choice: only its fused kernel reads a tensor LR on the GPU.
    """
    fused = device.type == "cuda" and os.environ.get(GRAPH_FUSED_ADAM_VAR, "1") != "0"
    for group in optimizer.param_groups:
        if isinstance(optimizer, torch.optim.SGD):
            group["fused"], group["foreach"] = True, False
        elif "capturable" in group:
            group["capturable"] = True
            if fused and "fused" in group:
                group["fused"], group["foreach"] = True, False
        else:
            raise ConfigError(
                f"{type(optimizer).__name__} cannot be captured",
                hint="use SGD, Adam or AdamW, or step eagerly",
            )
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor) or lr.device != device:  # a restore loads it on CPU
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
    lay_out_state(optimizer)  # e.g. 'step' restored on the CPU, a contiguous checkpoint's momentum


def given_flags(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The flags of each group before ``make_capturable`` (what ``saved_as_given`` writes)."""
    return [{k: group.get(k) for k in FLAGS if k in group} for group in optimizer.param_groups]


def saved_as_given(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], given: list[dict[str, Any]]
) -> dict[str, Any]:
    """``state_dict`` (an optimizer state_dict post hook's) with a float LR and the flags
    ``make_capturable`` changed set back to ``given``: a checkpoint of the captured optimizer
    loads into an eager one. A flag another hook rewrote (``speed_up`` leaves the kernel to the
    loader) is left as that hook wrote it."""
    live = optimizer.param_groups
    for saved, group, before in zip(state_dict["param_groups"], live, given, strict=False):
        if isinstance(saved.get("lr"), torch.Tensor):
            saved["lr"] = float(saved["lr"])
        for key, value in before.items():
            if group.get(key) != value and saved.get(key) == group.get(key):
                saved[key] = value
    return state_dict


def baked_settings(group: dict[str, Any]) -> dict[str, Any]:
    """A group's settings that a captured step bakes in: all but its parameters and LR (a
    tensor the graph reads), tensors by identity."""
    return {
        k: id(v) if isinstance(v, torch.Tensor) else v
        for k, v in group.items()
        if k not in ("params", "lr")
    }
