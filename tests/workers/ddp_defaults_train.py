"""``python -m hpc_ddp.train`` with DDP built on torch's defaults instead of ``ddp_options``.

For tests/test_train_ddp.py: the trainer's DDP settings must not change any result.
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


state.ddp_options = torch_defaults

if __name__ == "__main__":
    command.main(sys.argv[1:])
