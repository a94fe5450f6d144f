"""A DDP script that knows nothing of hpc-ddp, written for torchrun: ``init_process_group()``
reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; LOCAL_RANK and LOCAL_WORLD_SIZE come from
the environment. Each rank writes what it saw to OUT_DIR/rank<R>.json.

The one line a plain script would not have is the ``os._exit`` at the end: Gloo processes on
these machines sometimes abort at interpreter exit after ``destroy_process_group()`` (a torch
issue, not a launcher's), which would make the tests flaky. Usage: plain_ddp.py OUT_DIR
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([rank + 1.0])
dist.all_reduce(total)
seen = {
    "rank": rank,
    "world": world,
    "local_rank": int(os.environ["LOCAL_RANK"]),
    "local_world": int(os.environ["LOCAL_WORLD_SIZE"]),
    "master_addr": os.environ["MASTER_ADDR"],
    "sum": int(total.item()),
    "host": socket.gethostname(),
    "slurm_node": os.environ.get("SLURMD_NODENAME"),
}
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
    json.dump(seen, out)
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
