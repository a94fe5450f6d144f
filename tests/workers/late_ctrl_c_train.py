"""``hpc-ddp train`` where Ctrl-C lands while the trainer handles another error.

For tests/test_ctrl_c.py. A terminal's Ctrl-C reaches every rank at once; where a peer leaves
first, this rank's collective fails before its own SIGINT handler has run, and the handler's
KeyboardInterrupt then fires inside the trainer's handling of that failure. Two wrappers make
that order certain in one process, instead of a race between two:

- at ``--debug-hold-at-step N`` the step raises a RuntimeError (the failed collective's stand-in);
- ``Trainer.record_stop`` sends this process a real SIGINT before it records the stop.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from hpc_ddp.train import cli as command
from hpc_ddp.train import trainer

record_stop = trainer.Trainer.record_stop


def failing_step(self: trainer.Trainer, *_args: Any) -> None:
    raise RuntimeError("stand-in for a collective that failed because a peer left")


def record_stop_under_ctrl_c(self: trainer.Trainer, *args: Any, **kwargs: Any) -> None:
    os.kill(os.getpid(), signal.SIGINT)  # its handler runs at the next call: in the record
    record_stop(self, *args, **kwargs)


trainer.Trainer.hold_for_signal = failing_step  # type: ignore[method-assign]
trainer.Trainer.record_stop = record_stop_under_ctrl_c  # type: ignore[method-assign]

if __name__ == "__main__":
    command.main(sys.argv[1:])
