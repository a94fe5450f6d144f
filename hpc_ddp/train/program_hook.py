"""The trainer's hook: what it answers the deployment layer about a trainer command line.

``HOOK`` is the ``hpc_ddp.programs`` entry point of ``hpc_ddp.train`` (pyproject.toml; the
command line and the public API also register it, hpc_ddp/programs.py). Every answer comes from
the parser the trainer itself uses (config.py), so ``--run-dir=x``, an abbreviated flag or a
``--config`` file mean to a job's checks what they mean to the trainer. Torch-free, like config.py:
jobs are described on login nodes.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from hpc_ddp import Check, JobNeeds, ProgramFlags, ProgramHook
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_dir.paths import RunPaths
from hpc_ddp.train import config, results


class _TrainerParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(
            f"the trainer would refuse its arguments: {message}",
            hint="`hpc-ddp train --help` lists the trainer's flags",
        )


def given_flags(args: Sequence[str]) -> argparse.Namespace:
    """The trainer flags given in ``args`` (only those: defaults are not filled in). Arguments
    the trainer does not know are left to the trainer, which names them when it starts."""
    parser = _TrainerParser(prog="python -m hpc_ddp.train", add_help=False)
    config.add_arguments(parser)
    flags, _unknown = parser.parse_known_args(list(args))
    return flags


@dataclass(frozen=True, kw_only=True)
class TrainerNeeds(JobNeeds):
    """The trainer's settings, and with them its data dir: there, or downloaded there."""

    cfg: config.TrainConfig = field(default_factory=config.TrainConfig)

    def summary_lines(self, where: Callable[[str], str]) -> list[str]:
        t = self.cfg
        if t.synthetic:
            return [f"  data: synthetic {t.dataset} (no files read)"]
        if t.download:
            return [
                f"  data: {t.dataset} in {where(t.data_dir)}, downloaded there if missing (the "
                "nodes need internet access, or download it first)"
            ]
        return [f"  data: {t.dataset} in {where(t.data_dir)} (must exist)"]

    def checks(self, workdir: Path) -> list[Check]:
        return [check_data_dir(self.cfg, workdir)]


def check_data_dir(t: config.TrainConfig, workdir: Path) -> Check:
    path = workdir / t.data_dir
    if t.synthetic:
        return Check("OK", "data dir", f"synthetic {t.dataset}: no files needed")
    if path.is_dir() and any(path.iterdir()):
        return Check("OK", "data dir", f"{path} exists")
    if not t.download:
        return Check(
            "FAIL", "data dir", f"{path} is missing or empty and --no-download is set",
            "put the dataset there first, or let the trainer download it",
        )  # fmt: skip
    parent = path if path.is_dir() else path.parent
    if not os.access(parent, os.W_OK):
        return Check("FAIL", "data dir", f"{path} is missing and {parent} is not writable")
    return Check(
        "WARN",
        "data dir",
        f"{path} is empty: the trainer will download {t.dataset} there",
        "compute nodes often have no internet access: download it on the login node first",
    )


class TrainerHook(ProgramHook):
    """``python -m hpc_ddp.train``'s answers."""

    name = "the trainer"
    default_run_dir = config.TrainConfig().run_dir

    def flags(self, args: Sequence[str]) -> ProgramFlags:
        given = given_flags(args)
        names = getattr(given, "requeue_signals", None)
        if names is None:
            names = config.TrainConfig().requeue_signals
        return ProgramFlags(
            run_dir=getattr(given, "run_dir", None),
            settings_file=getattr(given, "config", None),
            signals=tuple(name.strip().upper().removeprefix("SIG") for name in names),
        )

    def run_paths(self, args: Sequence[str], workdir: str | Path) -> RunPaths:
        """Its ``--run-dir``, else its ``--config`` file's run_dir (a relative file is read from
        ``workdir``), else the trainer's default."""
        given = given_flags(args)
        if getattr(given, "config", None):
            given.config = str(Path(workdir) / given.config)  # an absolute path stays as it is
        return RunPaths(Path(workdir) / config.from_args(given).run_dir)

    def result_lines(self, result: Mapping[str, Any]) -> list[str]:
        return results.result_lines(result)

    def job_needs(self, args: Sequence[str]) -> TrainerNeeds:
        cfg = config.from_args(given_flags(args))
        return TrainerNeeds(run_dir=cfg.run_dir, imports=("hpc_ddp", "torch"), cfg=cfg)

    def launcher_requeue_args(self, signals: Sequence[str]) -> list[str]:
        return ["--requeue", "none", "--requeue-signal", ",".join(signals)]


HOOK = TrainerHook()
