"""The run directory's rules: one run at a time, never two experiments mixed, never overwritten.

- A lock (the checkpoint package's RunDirLock, taken by rank 0) is held for the whole run: a
  second run pointed at the same directory fails at once, naming the holder.
- ``config.json`` records the resolved config of the run. Once a checkpoint or a result exists,
  a later start whose identity settings (model, data, optimizer, seed, ...: ``IDENTITY_KEYS``)
  differ is refused: resuming would mix two experiments.
- A directory with checkpoints resumes; one with ``result.json`` is finished and left alone,
  unless the start asks for more epochs than it trained: then it continues from its newest
  checkpoint to the new end, and its first new checkpoint removes the old ``result.json``
  (Trainer.save), so that a ``result.json`` always describes the newest checkpoint.
- Only a directory the trainer made is used (run_marker.py): one holding other files is refused
  before anything is written into it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hpc_ddp.checkpoint.lock import RunDirLock
from hpc_ddp.errors import ConfigError
from hpc_ddp.log import get_logger
from hpc_ddp.run_paths import STEP_PREFIX, RunPaths
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.results import finished_epochs, read_json, write_json
from hpc_ddp.train.run_marker import claim_run_dir

log = get_logger("train")


@dataclass
class RunDirState:
    finished: bool  # result.json of this run, with at least cfg.epochs: nothing to do


def open_run_dir(cfg: TrainConfig, lock: RunDirLock) -> RunDirState:
    """Rank 0: claim the directory, take the lock, check it against ``cfg``, record
    ``config.json``."""
    paths = RunPaths(cfg.run_dir)
    run_dir = paths.root
    claim_run_dir(run_dir)  # before the lock, whose files would be the first written there
    lock.acquire()  # raises RunDirLockedError (exit 2) if another run holds it
    saved_path = paths.config
    if saved_path.exists():
        try:
            saved = read_json(saved_path)
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{saved_path} is unreadable ({err})",
                hint="restore it, or give this run a new --run-dir",
            ) from None
        changed = cfg.identity_changes(saved)
        # Until a checkpoint or a result exists, nothing of the old settings is at stake.
        started = paths.result.exists() or any(paths.checkpoints.glob(f"{STEP_PREFIX}*"))
        if changed and started:
            diffs = ", ".join(f"{k}: {was!r} -> {now!r}" for k, (was, now) in changed.items())
            raise ConfigError(
                f"run dir {run_dir} holds a run with different settings ({diffs})",
                hint="use a new --run-dir for a new experiment, or the original settings to "
                "resume it (only settings such as paths, logging and requeue may change)",
            )
    if paths.result.exists():
        done = _finished_epochs(paths)
        if done >= cfg.epochs:
            return RunDirState(finished=True)
        if not any(paths.checkpoints.glob(f"{STEP_PREFIX}*")):
            raise ConfigError(
                f"run dir {run_dir} finished {done} epoch(s) but holds no checkpoint to continue "
                f"from to --epochs {cfg.epochs}",
                hint=f"train {cfg.epochs} epochs in a new --run-dir",
            )
        log.info(
            f"run dir {run_dir} finished {done} epoch(s) (result.json); --epochs {cfg.epochs} "
            "continues it from its newest checkpoint (result.json is written again at the end)"
        )
    write_json(saved_path, cfg.to_dict())
    if paths.wants_nccl_trace(os.environ):  # torch writes dumps there but never makes the dir
        paths.nccl_trace.mkdir(exist_ok=True)
    return RunDirState(finished=False)


def _finished_epochs(paths: RunPaths) -> int:
    """The epochs the finished run in ``paths`` trained, from its result.json."""
    try:
        result = read_json(paths.result)
    except (OSError, ValueError) as err:
        result, problem = None, f"is unreadable ({err})"
    else:
        problem = "is not a finished run's result (status 'finished', epochs a whole number >= 1)"
    done = finished_epochs(result)
    if done is None:
        raise ConfigError(
            f"{paths.result} {problem}",
            hint="restore it; or move it aside, and the run resumes from its newest checkpoint",
        )
    return done
