"""Optimizer, learning-rate schedule and mixed-precision choice from a TrainConfig."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

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
        return torch.optim.SGD(
            params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
        )
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


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
