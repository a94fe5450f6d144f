"""Print what hpc_ddp.cluster.detect_env says for this process, as one JSON line.

Unlike `hpc-ddp env`, which reports CPU wherever no NVIDIA driver is loaded, this counts GPUs
from CUDA_VISIBLE_DEVICES alone: on the local cluster's fake GPUs (gres over char devices) it
shows which devices Slurm handed each task. Usage: env_probe.py [GPUS_PER_PROCESS]
"""

from __future__ import annotations

import json
import os
import sys

from hpc_ddp.cluster import detect_env

if __name__ == "__main__":
    gpp = int(sys.argv[1]) if len(sys.argv) > 1 else None
    record = detect_env(gpus_per_process=gpp).to_json()
    record["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    print(json.dumps(record), flush=True)
