"""Optimizer, learning-rate schedule, mixed-precision and memory-format choice from a
TrainConfig."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hpc_ddp.errors import ConfigError
from hpc_ddp.train.config import TrainConfig


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    """bf16 on GPU by default (no GradScaler needed); fp16 uses one; CPU trains in fp32."""
    mode = cfg.amp if cfg.amp != "auto" else ("bf16" if device.type == "cuda" else "off")
    if mode != "off" and device.type != "cuda":
        raise ConfigError(f"amp={cfg.amp} needs a GPU", hint="use --amp off (or auto) on CPU")
    return {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mode]


def build_optimizer(
    cfg: TrainConfig, params: Iterable[torch.nn.Parameter]
) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return without_dynamo(torch.optim.SGD)(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return without_dynamo(torch.optim.AdamW)(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


# The Optimizer methods torch wraps so that torch.compile leaves them alone.
_WRAPPED_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict", "step")


@functools.cache
def without_dynamo(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``base`` with torch's own methods, minus the wrappers that import ``torch._dynamo``.

    torch.optim wraps step, zero_grad, add_param_group (run by the constructor), state_dict and
    load_state_dict so that torch.compile does not trace into them; each wrapper imports
    torch._dynamo on first use, which takes seconds and would be the largest part of the time to
    first step (benchmarks/NOTES.md). The trainer never compiles, so nothing traces and the
    unwrapped methods do exactly what the wrapped ones do (tests/test_optim.py compares weights and
    state dicts bit for bit). Falls back to ``base`` if a torch release moves the import into the
    methods themselves.
    """
    methods = {name: inspect.unwrap(getattr(base, name)) for name in _WRAPPED_METHODS}
    if any("_dynamo" in method.__code__.co_names for method in methods.values()):
        return base
    raw_step = methods.pop("step")

    def step(self: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
        with torch.set_grad_enabled(self.defaults["differentiable"]):  # as step's wrapper does
            return raw_step(self, closure)

    namespace = {**methods, "step": step, "__doc__": base.__doc__, "__module__": __name__}
    cls = type(base.__name__, (base,), namespace)
    cls.__qualname__ = f"without_dynamo({base.__name__})"
    return cls


def lr_lambda(cfg: TrainConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warm-up, then cosine to 0 at ``total_steps`` (or constant), per optimizer step."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        span = max(total_steps - cfg.warmup_steps, 1)
        return 0.5 * (1 + math.cos(math.pi * min(step - cfg.warmup_steps, span) / span))

    return factor
