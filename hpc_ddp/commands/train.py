"""``hpc-ddp train``: run one process of the resumable DDP trainer.

Start it once per process under any launcher (srun, torchrun, submitit, pdsh/clush) or alone.
Exit codes: 0 finished (or already finished), 1 crashed, 2 bad input, 75 checkpointed after a
preemption/time-limit signal and requeued (EX_TEMPFAIL). The process always leaves through
``hpc_ddp.dist.run_main``, never through interpreter teardown (see shared/facts.md: Gloo exit
abort).
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from hpc_ddp.errors import HpcDdpError
from hpc_ddp.train import config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser)


def run(args: argparse.Namespace) -> NoReturn:
    cfg = config.from_args(args)  # bad settings fail here (exit 2), before torch is imported

    from hpc_ddp.dist import run_main
    from hpc_ddp.train.trainer import train

    # run_main prints any error with this process's rank and exits with its code, via os._exit.
    run_main(lambda: train(cfg).exit_code)


def main(argv: list[str]) -> NoReturn:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.train", description=__doc__)
    add_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except HpcDdpError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
