"""Timings of the embedded local Slurm cluster (figures quoted in docs/local-cluster.md).

    .venv/bin/python benchmarks/local_cluster.py [--starts 10] [--jobs 20]

Measures: start (nothing -> every node idle) and stop; sbatch -> batch script running (the
script records its own start time); `srun -N2 true` from outside an allocation; a 2-node
sbatch + wait until slurmctld reports the job COMPLETED. Needs root and slurm-wlm.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from hpc_ddp.localslurm import LocalCluster


def _summary(name: str, samples: list[float]) -> dict[str, float | str | int]:
    ordered = sorted(samples)
    return {
        "what": name,
        "n": len(samples),
        "min_s": round(ordered[0], 3),
        "median_s": round(statistics.median(ordered), 3),
        "max_s": round(ordered[-1], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=20)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hpcddp-bench-", dir="/tmp"))
    starts, stops = [], []
    for _ in range(args.starts):
        cluster = LocalCluster(root / "c", nodes=2)
        t0 = time.monotonic()
        cluster.start()
        starts.append(time.monotonic() - t0)
        t0 = time.monotonic()
        cluster.stop()
        stops.append(time.monotonic() - t0)

    cluster = LocalCluster(root / "c", nodes=2)
    cluster.start()
    client = cluster.client()
    latency, srun, roundtrip = [], [], []
    try:
        script = root / "stamp.sh"
        script.write_text('#!/bin/bash\ndate +%s.%N > "$1"\n')
        for i in range(args.jobs):
            stamp = root / f"stamp-{i}"
            # slurmctld starts batch jobs from a once-a-second background loop: without a random
            # pause, back-to-back samples lock onto one phase of it and all read alike.
            time.sleep(random.random())
            submitted = time.time()
            job_id, _ = client.sbatch(script, output=root / "out-%j", script_args=[str(stamp)])
            client.wait_job(job_id, 30)
            latency.append(float(stamp.read_text()) - submitted)
        for _ in range(args.jobs):
            t0 = time.monotonic()
            proc = client.srun(["-N2", "true"])
            assert proc.returncode == 0, proc.stderr
            srun.append(time.monotonic() - t0)
        job = root / "two_nodes.sh"
        job.write_text("#!/bin/bash\nsrun hostname\n")
        for _ in range(5):
            t0 = time.monotonic()
            res = client.sbatch_wait(job, "-N2", timeout_s=60, output=root / "two-%j")
            assert res.exit_code == 0, res.output
            roundtrip.append(time.monotonic() - t0)
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    rows = [
        _summary("start (2 nodes idle)", starts),
        _summary("stop (no jobs)", stops),
        _summary("sbatch -> batch script running", latency),
        _summary("srun -N2 true (outside an allocation)", srun),
        _summary("2-node sbatch -> COMPLETED seen", roundtrip),
    ]
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
