"""The answer to a finished run's command, run again: its result, without torch or workers.

``hpc-ddp train`` (alone or with ``--nproc-per-node``) asks :func:`finished_result` before it
imports torch. A run dir whose ``result.json`` belongs to a run with this command's identity
settings (``config.IDENTITY_KEYS``, the rule ``run_dir_rules.open_run_dir`` applies) that trained at
least this command's ``--epochs`` is finished: ``result.json`` is written after the last
checkpoint committed, and stays until a trainer continues the run to more epochs (removed with
that trainer's first checkpoint, written again at the new end); the run dir rules never let
another run train there. So the command prints what the trainer printed at the end and exits 0,
in a fraction of a second instead of an interpreter that imports torch, starts the workers and
the process group only to find nothing to do.

Anything else goes to the trainer: no result, more epochs (continued there), other identity settings
(refused there with the differences named), an unreadable file. So does a process that is one rank
of a launch of several (srun, torchrun, ...): those ranks decide together, through the process
group, since one of them alone could read a file system the others do not see the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.results import finished_epochs, read_json, summary_lines


def launched_alone(cfg: TrainConfig) -> bool:
    """True when no launcher started this process as one of several (the command then starts
    every process of the run itself, or is the only one)."""
    from hpc_ddp import detect_env

    try:
        return detect_env(gpus_per_process=cfg.gpus_per_process or None).world_size == 1
    except HpcDdpError:  # a broken launch environment: the trainer reports it
        return False


def finished_result(cfg: TrainConfig) -> dict[str, Any] | None:
    """``result.json`` of ``cfg.run_dir`` when it holds a finished run of ``cfg``'s identity."""
    paths = RunPaths(cfg.run_dir)
    try:
        result, recorded = read_json(paths.result), read_json(paths.config)
    except (OSError, ValueError):
        return None
    done = finished_epochs(result)
    if done is None or done < cfg.epochs or not isinstance(recorded, dict):
        return None  # more epochs: the trainer continues the run (run_dir_rules.open_run_dir)
    if cfg.identity_changes(recorded):
        return None
    return result


def finished_answer(run_dir: str | Path, result: dict[str, Any], epochs: int) -> list[str]:
    """What a finished run's command prints (rank 0), with or without the trainer; ``epochs``:
    the command's, which may be fewer than the run trained."""
    lines = [f"run dir {run_dir} already finished (result.json); nothing to do"]
    done = finished_epochs(result)
    if done is not None and epochs < done:
        lines.append(
            f"(--epochs {epochs} is fewer than the {done} it trained: a finished run is never "
            "cut back; more epochs than it trained continue it)"
        )
    return [*lines, *summary_lines(result, run_dir)]
