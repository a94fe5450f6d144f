"""``python -m hpc_ddp.train [flags]``: the same as ``hpc-ddp train [flags]``."""

from __future__ import annotations

import sys

from hpc_ddp.commands import train as command

if __name__ == "__main__":
    command.main(sys.argv[1:])
