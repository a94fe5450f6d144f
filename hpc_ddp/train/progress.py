"""Progress: where training stands; in every checkpoint, so a resume continues every counter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.train.loop import Times


@dataclass
class Progress:
    epoch: int = 0  # current epoch (0-based)
    start: int = 0  # GLOBAL samples of this epoch already trained on (a step boundary)
    global_step: int = 0
    epoch_loss_sum: float = 0.0
    epoch_loss_count: float = 0.0
    epoch_times: dict[str, float] = field(default_factory=lambda: Times().to_dict())
    samples_total: int = 0  # global training samples over all attempts
    train_seconds: float = 0.0  # time inside steps over all attempts
    wall_seconds: float = 0.0  # wall time up to the last checkpoint
    interruptions: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # one metrics row per epoch
