"""``hpc-ddp train``: run one process of the resumable DDP trainer.

Start it once per process under any launcher (srun, torchrun, submitit, pdsh/clush) or alone;
``--nproc-per-node N`` starts a single machine's N processes itself (hpc_ddp.spawn: forked, so
workers start in a fraction of torchrun's time). A process that uses GPUs creates its CUDA
contexts while it imports torch (hpc_ddp.early_cuda).
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
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="start N processes on this machine (one per GPU), forked by this one; "
        "not under another launcher (default: 1, this process alone)",
    )


def run(args: argparse.Namespace) -> NoReturn:
    cfg = config.from_args(args)  # bad settings fail here (exit 2), before torch is imported

    def import_trainer() -> None:
        import hpc_ddp.train.trainer  # noqa: F401  (torch and everything the trainer uses)

    def body() -> int:
        from hpc_ddp.train.trainer import train

        return train(cfg).exit_code

    from hpc_ddp.spawn import run_ranks

    run_ranks(
        body,
        args.nproc_per_node,
        imports=import_trainer,
        gpus_per_process=cfg.gpus_per_process or None,
    )


def main(argv: list[str]) -> NoReturn:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.train", description=__doc__)
    add_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except HpcDdpError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
