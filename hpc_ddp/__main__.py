"""``python -m hpc_ddp`` is the ``hpc-ddp`` command, for where only the interpreter is on PATH
(inside a container, a job step's bare environment)."""

import sys

from hpc_ddp.cli import main

sys.exit(main())
