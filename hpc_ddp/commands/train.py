"""``hpc-ddp train``: the trainer's own command line, which lives with the trainer
(hpc_ddp.train.cli): the command layer only dispatches to it."""

from hpc_ddp.train.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
