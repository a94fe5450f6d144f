"""``python -m hpc_ddp.train`` with DDP wherever gradients are averaged eagerly, Gloo included,
built with the trainer's ``ddp_options``, or with torch's defaults when the first argument is
``--torch-ddp-defaults``.

For tests/test_train_ddp.py: the trainer averages per tensor without DDP over Gloo, so this is
how a CPU test still builds DDP to compare with; neither the trainer's DDP settings nor its
averaging without DDP may change any result.
"""

from __future__ import annotations

import sys

from hpc_ddp.train import cli as command
from hpc_ddp.train.fast import choice as fast

TORCH_DEFAULTS = "--torch-ddp-defaults"
trainer_options, trainer_sync = fast.ddp_options, fast.gradient_sync


def always_ddp(backend: str, world_size: int, captured: bool) -> str:
    """The trainer's choice, with DDP where it would average per tensor (Gloo)."""
    sync = trainer_sync(backend, world_size, captured)
    return "ddp" if sync == "per_tensor" else sync


def announced_options(net: object, **kwargs: object) -> dict[str, bool]:
    """The options DDP is built with, said on each rank, so the test knows DDP was built."""
    if torch_defaults:  # {}: forward_sync_buffers=True, gradient_as_bucket_view=False
        print("DDP built with torch's defaults", flush=True)
        return {}
    print("DDP built with the trainer's options", flush=True)
    return trainer_options(net, **kwargs)  # type: ignore[arg-type]


torch_defaults = sys.argv[1:2] == [TORCH_DEFAULTS]
fast.gradient_sync = always_ddp  # where the trainer's plan_step and StepPlan look them up
fast.ddp_options = announced_options

if __name__ == "__main__":
    command.main(sys.argv[2:] if torch_defaults else sys.argv[1:])
