"""``python -m hpc_ddp.train`` with DDP, built on torch's defaults instead of ``ddp_options``.

For tests/test_train_ddp.py: neither the trainer's DDP settings nor its averaging over Gloo
without DDP may change any result.
"""

from __future__ import annotations

import sys

from hpc_ddp.commands import train as command
from hpc_ddp.train import state


def torch_defaults(net: object, **_: object) -> dict[str, bool]:
    """{}: forward_sync_buffers=True, gradient_as_bucket_view=False; says so, so the test knows
    this replacement is what the trainer called."""
    print("DDP built with torch's defaults", flush=True)
    return {}


def always_ddp(backend: str, world_size: int, captured: bool) -> str:
    """DDP wherever gradients are averaged eagerly, Gloo included (the trainer averages per
    tensor there without DDP): the test compares the two."""
    return "ddp" if world_size > 1 and not captured else "none"


state.ddp_options = torch_defaults
state.gradient_sync = always_ddp

if __name__ == "__main__":
    command.main(sys.argv[1:])
