"""``hpc-ddp train``: run one process of the resumable DDP trainer.

Start it once per process under any launcher (srun, torchrun, submitit, pdsh/clush) or alone;
``--nproc-per-node N`` starts a single machine's N processes itself (hpc_ddp.spawn: forked after
the imports, so workers start in a fraction of torchrun's time).
Exit codes: 0 finished (or already finished), 1 crashed, 2 bad input, 65 the loss became NaN or
infinite (stopped, the last finite checkpoint kept), 75 checkpointed after a preemption/time-limit
signal and requeued (EX_TEMPFAIL). A run dir that already holds this run's result is answered
before torch is imported (hpc_ddp/train/finished.py); one asked for more epochs than it trained
is continued to them. Otherwise the process leaves through ``hpc_ddp.dist.run_main``, never
through interpreter teardown, where Gloo can abort after the work is done
(docs/troubleshooting.md); the ``--nproc-per-node`` parent too, once its workers have ended.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from hpc_ddp import schema
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.extras import require
from hpc_ddp.train import config
from hpc_ddp.train.finished import finished_answer, finished_result, launched_alone
from hpc_ddp.train.metric_writers import check_installed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    config.add_arguments(parser)
    parser.add_argument(
        "--nproc-per-node",
        type=schema.number_type(int, schema.NPROC_PER_NODE),
        default=1,
        metavar="N",
        help="fork N worker processes on this machine (one per GPU) after the imports, and wait "
        "for them; not under another launcher (default: 1: no fork, this process trains)",
    )


def run(args: argparse.Namespace) -> NoReturn:
    cfg = config.from_args(args)  # bad settings fail here (exit 2), before torch is imported
    if args.nproc_per_node >= 1 and launched_alone(cfg):
        result = finished_result(cfg)
        if result is not None:
            print("\n".join(finished_answer(cfg.run_dir, result, cfg.epochs)), flush=True)
            sys.exit(0)
    require("train", "training")
    check_installed(cfg.metrics)  # --metrics tensorboard without it: said before torch loads

    from hpc_ddp import run_main, shutdown, spawn_workers
    from hpc_ddp.train.trainer import train  # imports torch: before any fork, on purpose

    def worker() -> NoReturn:
        # One training, then the exit: no NCCL destroy on the way out. run_main prints any
        # error with this process's rank and exits with its code (os._exit).
        run_main(lambda: train(cfg, exiting=True).exit_code)

    if args.nproc_per_node == 1:
        worker()
    code = spawn_workers(worker, args.nproc_per_node, gpus_per_process=cfg.gpus_per_process)
    # Like the workers, flush and leave without the interpreter's teardown: with torch and the
    # trainer imported it is a long wait after the job has ended (benchmarks/NOTES.md).
    shutdown(code)


def main(argv: list[str]) -> NoReturn:
    parser = argparse.ArgumentParser(prog="python -m hpc_ddp.train", description=__doc__)
    add_arguments(parser)
    try:
        run(parser.parse_args(argv))
    except HpcDdpError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)


def run_training(args: Sequence[str] = (), *, nproc_per_node: int = 1) -> NoReturn:
    """``hpc-ddp train ARGS --nproc-per-node N`` from Python (public as
    ``hpc_ddp.run_training``): in this process, or N forked from it. Never returns: like the
    command, it leaves with the run's exit code (0, 1, 2, 75) through ``os._exit``, because
    Gloo can abort at interpreter teardown after the work is done."""
    main([*args, "--nproc-per-node", str(nproc_per_node)])
