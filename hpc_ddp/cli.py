"""The ``hpc-ddp`` command: a thin dispatcher.

Each subcommand lives in ``hpc_ddp/commands/<name>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their command runs, so ``hpc-ddp --help``,
``env``, ``render`` and ``submit`` never pay for importing torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from hpc_ddp import __version__, programs
from hpc_ddp.errors import HpcDdpError

# name -> one-line help. The module hpc_ddp.commands.<name> does the work.
COMMANDS: dict[str, str] = {
    "env": "show the distributed environment this process was launched into",
    "train": "run the resumable DDP trainer (CIFAR): one process of a launched job, "
    "or N on this machine with --nproc-per-node N",
    "render": "render an sbatch script from a job description",
    "submit": "render and submit a job to Slurm (or a local cluster) through sbatch or submitit",
    "status": "show a submitted job's state, requeues, nodes, progress and result",
    "logs": "print (-f: follow) a submitted job's batch log and rank logs",
    "cancel": "checkpoint and end a submitted job (--now: kill it at once)",
    "exec": "run a program with torch's RANK, WORLD_SIZE, MASTER_ADDR... set from its "
    "launcher (srun, mpirun, pdsh/clush), or N copies on this machine",
    "launch": "start a job on hosts without a scheduler (pdsh or ClusterShell)",
    "doctor": "check that this machine or allocation has what a job needs",
    "cluster": "start, stop or inspect the embedded local Slurm cluster",
}


def _module_name(command: str) -> str:
    return f"hpc_ddp.commands.{command}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="hpc-ddp",
        description="PyTorch DDP from a laptop to a Slurm cluster: launch, train, checkpoint, "
        "requeue. `hpc-ddp COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"hpc-ddp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)

    # Parse only the command name first so that just one command module gets imported.
    known, _ = parser.parse_known_args(argv[:1] if argv and not argv[0].startswith("-") else argv)
    if known.command is None:
        parser.print_help()
        return 0
    # Every command that describes, submits or inspects a job asks the trainer about its
    # arguments through the trainer's hook: registered here, loaded only when a job needs it.
    programs.register()
    module = importlib.import_module(_module_name(known.command))
    command_parser = argparse.ArgumentParser(
        prog=f"hpc-ddp {known.command}", description=COMMANDS[known.command]
    )
    module.add_arguments(command_parser)
    args = command_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except HpcDdpError as err:
        print(f"hpc-ddp {known.command}: error: {err}", file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
