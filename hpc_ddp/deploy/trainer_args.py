"""What a job's trainer will do, read from its arguments with the trainer's own parser.

The deploy layer needs two answers from a trainer command line: which signals the trainer
checkpoints on (a JobSpec checks that Slurm's warning signal is one of them) and where its run
directory is (submit reports the run's result.json). Both come from ``hpc_ddp.train.config``,
the parser the trainer itself uses, so ``--run-dir=x``, an abbreviated flag or a ``--config``
file mean here what they mean there. A program of the user's is only asked for its
``--run-dir``, as written. Torch-free, like that module.
"""

from __future__ import annotations

import argparse
import itertools
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from hpc_ddp.deploy.core import TRAIN_MODULE
from hpc_ddp.errors import ConfigError
from hpc_ddp.run_paths import RunPaths
from hpc_ddp.train import config

# Words that end a command in a shell line (a rendered step runs in the background: `... &`).
_SHELL_OPERATORS = frozenset({"&", "&&", "|", "||", ";"})


class _TrainerParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(
            f"the trainer would refuse its arguments: {message}",
            hint="`hpc-ddp train --help` lists the trainer's flags",
        )


def trainer_flags(args: Sequence[str]) -> argparse.Namespace:
    """The trainer flags given in ``args`` (only those: defaults are not filled in). Arguments
    the trainer does not know are left to the trainer, which names them when it starts."""
    parser = _TrainerParser(prog="python -m hpc_ddp.train", add_help=False)
    config.add_arguments(parser)
    flags, _unknown = parser.parse_known_args(list(args))
    return flags


def listened_signals(args: Sequence[str]) -> list[str]:
    """The signals (without ``SIG``) on which a trainer run with ``args`` checkpoints."""
    given = getattr(trainer_flags(args), "requeue_signals", None)
    names = given if given is not None else config.TrainConfig().requeue_signals
    return [name.strip().upper().removeprefix("SIG") for name in names]


def trainer_run_paths(args: Sequence[str], workdir: str | Path) -> RunPaths:
    """The run directory of a trainer started in ``workdir`` with ``args``: its ``--run-dir``,
    else its ``--config`` file's run_dir (a relative file is read from ``workdir``), else the
    trainer's default. Raises ConfigError for arguments the trainer would refuse."""
    flags = trainer_flags(args)
    if getattr(flags, "config", None):
        flags.config = str(Path(workdir) / flags.config)  # an absolute path stays as it is
    return RunPaths(Path(workdir) / config.from_args(flags).run_dir)


def program_run_dir(args: Sequence[str]) -> str | None:
    """The run dir a program of the user's (not the trainer) is given: the last ``--run-dir X``
    or ``--run-dir=X`` of ``args``, before any ``--``. Read as written: the program's own parser
    is unknown, so neither an abbreviation nor a config file counts."""
    found, words = None, iter(args)
    for word in words:
        if word == "--":
            break
        if word == "--run-dir":
            found = next(words, None)
        elif word.startswith("--run-dir="):
            found = word.removeprefix("--run-dir=")
    return found or None


def trainer_args_in_script(text: str) -> list[str] | None:
    """The trainer's arguments in a batch script: the words after ``-m hpc_ddp.train`` on the
    (``\\``-continued) line that starts it, up to the end of that command; None if no line does.
    For a script without its spec, such as a committed ``jobs/*.sbatch``."""
    for line in text.replace("\\\n", " ").splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:  # an unbalanced quote: not a command line of ours
            continue
        for i in range(len(words) - 1):
            if words[i] == "-m" and words[i + 1] == TRAIN_MODULE:
                rest = words[i + 2 :]
                return list(itertools.takewhile(lambda w: w not in _SHELL_OPERATORS, rest))
    return None
