"""hpc_ddp.spawn.run_ranks with a body that only records where things ran, for tests/test_spawn.py.

    python run_ranks_worker.py gpu|cpu NPROC OUT_DIR

``imports`` writes OUT_DIR/imports.<pid> in each process that really imported torch; each rank's
body writes OUT_DIR/rank<R>.json with its pid, its parent's and whether torch was imported in it
before the body ran. ``gpu`` makes
hpc_ddp.early_cuda.wanted() answer yes (a GPU cannot exist on the CI machines): the rule under
test is only where the imports run. The script exits with the job's code.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hpc_ddp import early_cuda
from hpc_ddp.spawn import run_ranks


def main() -> None:
    kind, nproc, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    if kind == "gpu":
        early_cuda.wanted = lambda *_, **__: True  # type: ignore[assignment]

    def imports() -> None:  # may run twice in a process, as the trainer's import statements do
        if "torch" not in sys.modules:
            import torch  # noqa: F401

            (out / f"imports.{os.getpid()}").touch()

    def body() -> int:
        rank = os.environ.get("RANK", "0")
        record = {"pid": os.getpid(), "parent": os.getppid(), "torch": "torch" in sys.modules}
        (out / f"rank{rank}.json").write_text(json.dumps(record))
        return 0

    run_ranks(body, nproc, imports=imports)


if __name__ == "__main__":
    main()
