"""The run directory's identity check (train/run_dir_rules.py) across versions of config.json."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir import RunDirLock, claim_run_dir
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.run_dir_rules import open_run_dir


def started_run(run_dir: Path, cfg: TrainConfig, drop: str) -> None:
    """A run dir with a checkpoint, recorded by a version whose config.json lacked ``drop``."""
    claim_run_dir(run_dir, {})
    (run_dir / "checkpoints" / "step-00000001").mkdir(parents=True)
    saved = cfg.to_dict()
    del saved[drop]
    (run_dir / "config.json").write_text(json.dumps(saved))


def test_a_setting_added_later_reads_as_its_default(tmp_path: Path) -> None:
    cfg = TrainConfig(run_dir=str(tmp_path / "run"))
    started_run(tmp_path / "run", cfg, drop="synthetic_variant")
    lock = RunDirLock(tmp_path / "run")
    try:
        assert not open_run_dir(cfg, lock).finished  # resumes: "easy" was the only variant
    finally:
        lock.release()
    # open_run_dir recorded the full config.json above: start over without the key.
    cfg = dataclasses.replace(cfg, run_dir=str(tmp_path / "again"))
    started_run(tmp_path / "again", cfg, drop="synthetic_variant")
    hard = dataclasses.replace(cfg, synthetic_variant="hard")
    lock = RunDirLock(tmp_path / "again")
    try:
        with pytest.raises(ConfigError, match="synthetic_variant: 'easy' -> 'hard'"):
            open_run_dir(hard, lock)
    finally:
        lock.release()
