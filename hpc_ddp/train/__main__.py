"""``python -m hpc_ddp.train [flags]``: the same as ``hpc-ddp train [flags]``."""

from __future__ import annotations

import sys

from hpc_ddp.train.cli import main

if __name__ == "__main__":
    main(sys.argv[1:])
