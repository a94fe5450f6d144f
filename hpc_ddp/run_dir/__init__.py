"""A run directory (the trainer's ``--run-dir``): its names, its marker, its lock.

Everything a run leaves in its directory, by name (``paths.py``, ``RunPaths``)::

    <run dir>/
      .hpc-ddp-run        marker: the toolkit made this directory (marker.py, claim_run_dir)
      .run.lock           the lock rank 0 holds for the whole run (lock.py, RunDirLock)
      .run.lock.owner     who holds it: pid, host, Slurm job
      .requeue-job-J-restart-R   checkpointed, requeue left to the batch shell (torchrun layout):
                          rank 0 writes it, the job's batch shell reads and removes it
      config.json         the resolved settings of the run
      progress.json       where training stands, for monitors (rank 0, updated while it runs),
                          and under Slurm the job and restart count that wrote it
      metrics.jsonl       one line per finished epoch
      metrics.csv         with --metrics csv: one row per progress line and per epoch
      tensorboard/        with --metrics tensorboard: TensorBoard event files, one per attempt
      result.json         the outcome, written once at the end
      plot.png            loss and accuracy per epoch
      nccl_trace/         NCCL flight recorder dumps, written on a timeout
      checkpoints/
        latest            name of the newest committed checkpoint (a plain file, not a link)
        step-00000040/    one committed checkpoint: manifest.json, shared.pt, rank-00000.pt...

Torch-free and below every layer that uses a run dir: deploy reads a job's result through
``RunPaths``, the checkpoints (``hpc_ddp.checkpoint``, whose commit protocol moves ``latest``)
name their files through it, the trainer claims and locks the directory through this package
and applies its own rules on top (``hpc_ddp/train/run_dir_rules.py``: one experiment per
directory, a finished run left alone).
"""

from .lock import RunDirLock, RunDirLockedError, RunDirUnwritableError
from .marker import claim_run_dir
from .paths import RunPaths

__all__ = [
    "RunDirLock",
    "RunDirLockedError",
    "RunDirUnwritableError",
    "RunPaths",
    "claim_run_dir",
]
