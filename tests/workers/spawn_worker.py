"""hpc_ddp.spawn.launch with small torch-free workers, for tests/test_spawn.py.

    python spawn_worker.py MODE NPROC OUT_DIR

Each worker writes OUT_DIR/rank<R>.json (its pid and the launcher variables it saw) and then:
  codes:<c0>,<c1>,...  exits with its code from the list
  signal               waits (bounded) for SIGUSR1, records it, exits 75
  hang-unless-term     rank 1 exits 3 once the others wrote their files; the others wait
                       (bounded) to be stopped by the supervisor's SIGTERM
  usr1-then-hang-unless-term
                       each waits (bounded) for SIGUSR1 and goes on: then hang-unless-term
  term-parent          rank 0 sends the parent SIGTERM at once (as `timeout` would, while the
                       parent is still forking the others); each waits (bounded) to get it
The script exits with launch()'s return value. HPC_DDP_MAX_NPROC is passed on to launch(), and
the soft limit on open files is raised to the hard one first (`ulimit -n`): the parent holds a
descriptor per worker.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import threading
import time
from pathlib import Path

from hpc_ddp.env_vars import MAX_NPROC_VAR as LIMIT
from hpc_ddp.spawn import launch

WAIT_S = 60.0  # every wait below ends by itself: a broken supervisor fails the test, not hangs


def main() -> None:
    mode, nproc, out = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    def worker() -> None:
        rank = int(os.environ["RANK"])
        seen = {k: v for k, v in os.environ.items() if k.startswith("HPC_DDP_") or k in VARS}
        got = threading.Event()
        signal.signal(signal.SIGUSR1, lambda *_: got.set())
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
        tmp = out / f".rank{rank}.json"
        tmp.write_text(json.dumps({"pid": os.getpid(), "env": seen}))
        tmp.rename(out / f"rank{rank}.json")  # whole or absent: rank 1 polls for it
        if mode == "term-parent":
            if rank == 0:
                os.kill(os.getppid(), signal.SIGTERM)
            got.wait(WAIT_S)  # the forwarded SIGTERM exits 143 first
            os._exit(1)
        if mode.startswith("codes:"):
            os._exit(int(mode.split(":")[1].split(",")[rank]))
        if mode == "signal":
            (out / f"ready{rank}").touch()
            os._exit(75 if got.wait(WAIT_S) else 1)
        if mode == "usr1-then-hang-unless-term":
            (out / f"ready{rank}").touch()
            if not got.wait(WAIT_S):
                os._exit(1)
            got.clear()  # SIGTERM, not the USR1 already seen, must end the wait below
        if mode in ("hang-unless-term", "usr1-then-hang-unless-term"):
            if rank == 1:  # once the others are up and recorded: their pids are what is checked
                others = [out / f"rank{r}.json" for r in range(nproc) if r != 1]
                deadline = time.monotonic() + WAIT_S
                while not all(p.exists() for p in others) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os._exit(3)
            got.wait(WAIT_S)  # SIGTERM from the supervisor exits 143 first
            os._exit(0)
        os._exit(99)

    # Not the test's own environment (it may hold launcher variables): the setting only.
    sys.exit(launch(worker, nproc, environ={k: v for k, v in os.environ.items() if k == LIMIT}))


VARS = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}

if __name__ == "__main__":
    main()
