"""The resumable DDP trainer (torch lives here). See docs/training.md.

``from hpc_ddp.train import TrainConfig`` stays cheap: the torch-heavy names are imported on
first use, so the deploy layer can build a config without paying for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_ddp.exit_codes import EXIT_DIVERGED, EXIT_REQUEUE
from hpc_ddp.train.config import TrainConfig

if TYPE_CHECKING:
    from hpc_ddp.train.results import Result
    from hpc_ddp.train.trainer import run_process, train

__all__ = ["EXIT_DIVERGED", "EXIT_REQUEUE", "Result", "TrainConfig", "run_process", "train"]

_LAZY = {
    "train": "hpc_ddp.train.trainer",
    "run_process": "hpc_ddp.train.trainer",
    "Result": "hpc_ddp.train.results",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hpc_ddp.train' has no attribute {name!r}")
