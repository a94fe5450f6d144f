"""``python -m hpc_ddp.deploy.port``: print the rendezvous port for this Slurm job.

The torchrun template calls this from the batch shell so that shell and Python share one port
rule (``hpc_ddp.cluster.master_port.master_port``): an explicit MASTER_PORT wins, else one
derived from the job id.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from hpc_ddp.cluster.master_port import master_port


def job_port(environ: Mapping[str, str] | None = None) -> int:
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id and not env.get("MASTER_PORT"):
        print("hpc_ddp.deploy.port: no SLURM_JOB_ID: run inside a Slurm job", file=sys.stderr)
        raise SystemExit(2)
    return master_port(env, job_id or None)


if __name__ == "__main__":
    print(job_port())
