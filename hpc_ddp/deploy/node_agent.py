"""Old name of :mod:`hpc_ddp.deploy.shell.node_agent`, kept for launch scripts rendered before
the move (they run ``python -m hpc_ddp.deploy.node_agent``)."""

from __future__ import annotations

import sys

from hpc_ddp.deploy.shell.node_agent import main

if __name__ == "__main__":
    print(
        "hpc-ddp: note: hpc_ddp.deploy.node_agent moved to hpc_ddp.deploy.shell.node_agent; "
        "re-render this launch script (hpc-ddp launch ... --render-script)",
        file=sys.stderr,
    )
    sys.exit(main())
