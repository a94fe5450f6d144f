"""What rank 0 tells the world while and after a run trains: progress.json and the Result."""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import Literal

from hpc_ddp.log import get_logger
from hpc_ddp.run_dir.paths import PROGRESS_SLURM_JOB, RunPaths, slurm_attempt
from hpc_ddp.train import results
from hpc_ddp.train.divergence import TrainingDiverged
from hpc_ddp.train.fingerprint import params_sha256
from hpc_ddp.train.progress import Progress
from hpc_ddp.train.resume import Clock
from hpc_ddp.train.state import TrainState

log = get_logger("train")
ProgressStatus = Literal[
    "training", "holding", "preempted", "finished", "interrupted", "failed", "diverged"
]
ROUTINE_INTERVAL_S = 0.5


class ProgressFile:
    """progress.json, for monitors and tests (rank 0 writes, every rank calls). Routine updates
    at most every 0.5 s (a rename per step would load a parallel filesystem); status changes
    always. Under Slurm it names the job and its restarts: ``hpc-ddp status RUN_DIR`` reads
    them once the lock's owner file is gone."""

    def __init__(self, paths: RunPaths, rank: int, world_size: int) -> None:
        self.path = paths.progress
        self.rank, self.world_size = rank, world_size
        self.pids: list[int] = []  # every rank's, gathered when the run starts
        self.slurm_job = slurm_attempt(os.environ)
        self._written_at = float("-inf")

    def write(self, progress: Progress, status: ProgressStatus, **extra: str | int | None) -> None:
        now = time.monotonic()
        if status == "training" and now - self._written_at < ROUTINE_INTERVAL_S:
            return
        self._written_at = now
        if self.rank == 0:
            info = {"status": status, "epoch": progress.epoch, "step": progress.global_step}
            info.update(pids=self.pids, world_size=self.world_size, start=progress.start, **extra)
            if self.slurm_job is not None:
                info[PROGRESS_SLURM_JOB] = self.slurm_job
            results.write_json(self.path, info)

    def record_stop(self, progress: Progress, error: BaseException, *, ctrl_c: bool) -> None:
        """Training stopped by ``error``: progress.json says so (``interrupted`` after Ctrl-C,
        ``diverged`` when the loss became NaN or infinite, with that step and the checkpoint
        kept, else ``failed``) and when, instead of a ``training`` with dead pids."""
        interrupted = ctrl_c or isinstance(error, KeyboardInterrupt)
        why = "SIGINT (Ctrl-C)" if interrupted else f"{type(error).__name__}: {error}"
        stopped_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        status: ProgressStatus = "interrupted" if interrupted else "failed"
        extra: dict[str, str | int | None] = {}
        if isinstance(error, TrainingDiverged) and not interrupted:
            status, why = "diverged", error.message
            extra = {"diverged_at_step": error.step, "checkpoint": error.checkpoint}
        try:
            self.write(progress, status, stopped_at=stopped_at, reason=why, **extra)
        except OSError as err:  # the run dir may be what failed: the error itself still counts
            log.warning(f"could not record the stop in {self.path}: {err}")


def make_result(
    state: TrainState,
    progress: Progress,
    status: results.Status,
    code: int,
    *,
    world_size: int,
    clock: Clock,
    paths: RunPaths,
) -> results.Result:
    last = progress.history[-1] if progress.history else {}
    return results.Result(
        status=status,
        exit_code=code,
        epochs=progress.epoch,
        steps=progress.global_step,
        world_size=world_size,
        train_loss=last.get("train_loss"),
        test_loss=last.get("test_loss"),
        test_accuracy=last.get("test_accuracy"),
        test_samples=int(last.get("test_samples", 0)),
        samples_per_second=progress.samples_total / max(progress.train_seconds, 1e-9),
        wall_seconds=clock.elapsed(),
        train_wall_seconds=clock.loop_elapsed(),
        params_sha256=params_sha256(state.net.state_dict()),
        run_dir=str(paths.root),
        interruptions=progress.interruptions,
        extra={
            "allreduce_calls": state.stepper.comm_timer.bucket_calls,
            "cuda_graphs": state.captured,
        },
    )
