"""``hpc-ddp exec -- CMD``: run a program with torch's env:// variables set from its launcher.

A script written for torchrun (``init_process_group()`` with no arguments, ``LOCAL_RANK`` for its
device) reads ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``. srun, mpirun and the project's own launchers set other variables; this command
derives those six from them (``hpc_ddp.cluster.torch_contract``) and replaces itself with CMD, so
CMD keeps the pid that srun signals. Every rendered srun job runs its program through it, and a
hand-written sbatch file gets the same with ``srun hpc-ddp exec -- python train.py``.

``--nproc-per-node N`` starts CMD N times on this machine instead (as ``torchrun --standalone``
would), each with its own rank, supervised as ``hpc-ddp train --nproc-per-node`` supervises its
workers (hpc_ddp.spawn). Exit codes: CMD's own; 127 CMD not found; 2 bad launch variables.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn

from hpc_ddp import schema
from hpc_ddp.cluster import torch_contract
from hpc_ddp.errors import ConfigError

EXIT_NOT_FOUND = 127  # a shell's code for "command not found"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc-per-node",
        type=schema.number_type(int, schema.NPROC_PER_NODE),
        default=None,
        metavar="N",
        help="start CMD N times on this machine, ranks 0..N-1 (default: once, as this process, "
        "with the rank its launcher gave it)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")


def _exec(command: list[str]) -> NoReturn:
    try:
        os.execvp(command[0], command)
    except OSError as err:
        print(f"hpc-ddp exec: cannot run {command[0]!r}: {err.strerror}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(EXIT_NOT_FOUND)


def run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError(
            "no command to run", hint="put it after --, e.g. hpc-ddp exec -- python train.py"
        )
    if args.nproc_per_node is None:
        os.environ.update(torch_contract())
        _exec(command)
    from hpc_ddp.spawn import launch  # checks N against the machine before anything starts

    return launch(lambda: _exec(command), args.nproc_per_node)
