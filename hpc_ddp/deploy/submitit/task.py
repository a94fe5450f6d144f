"""``TrainTask``: what every submitit task runs, a ``submitit.helpers.Checkpointable``.

Each submitit task runs the trainer as a child process (``python -m hpc_ddp.train``), for two
reasons:

* the trainer leaves through ``os._exit`` (Gloo can abort in a C++ destructor at interpreter
  teardown, after the work is done), which would skip submitit's result pickle if it ran in
  submitit's process;
* the trainer checkpoints at a step boundary when its ranks agree, never inside a signal handler.

Preemption/time limit: Slurm (or the local controller) sends USR2 to every process. Our handler
forwards it to the trainer child and then calls submitit's own handler. On rank 0 that calls
``checkpoint()``, which waits for the child to finish its checkpoint and exit 75, then returns a
``DelayedSubmission`` of the same task; submitit requeues the job, and the new run resumes from
the run dir's newest checkpoint. Only this module's parent process is submitit's; it never
imports torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import submitit

from hpc_ddp.deploy.backend import read_result
from hpc_ddp.deploy.trainer_args import trainer_run_paths
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.exit_codes import EXIT_REQUEUE

PREEMPT_SIGNAL = signal.SIGUSR2  # submitit's (SUBMITIT_PREEMPT_SIGNAL); trainer told explicitly
CHILD_CHECKPOINT_TIMEOUT_S = 120.0


@dataclass
class TrainTask(submitit.helpers.Checkpointable):
    """Run ``python -m hpc_ddp.train ARGV`` in every submitit task; resumable."""

    argv: list[str]
    python: str = sys.executable
    env: dict[str, str] = field(default_factory=dict)
    _child: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def trainer_argv(self) -> list[str]:
        # submitit owns the requeue (its checkpoint path); the trainer checkpoints and exits 75.
        return [
            self.python, "-u", "-m", "hpc_ddp.train", *self.argv,
            "--requeue", "none", "--requeue-signal", f"{PREEMPT_SIGNAL.name},SIGTERM",
        ]  # fmt: skip

    def __call__(self) -> dict[str, Any]:
        env = submitit.JobEnvironment()
        previous = signal.getsignal(PREEMPT_SIGNAL)

        def forward(signum: int, frame: FrameType | None) -> None:
            if self._child is not None and self._child.poll() is None:
                self._child.send_signal(signum)
            if callable(previous):
                previous(signum, frame)  # submitit: rank 0 calls checkpoint() and requeues

        signal.signal(PREEMPT_SIGNAL, forward)
        self._child = subprocess.Popen(self.trainer_argv(), env={**os.environ, **self.env})
        # Poll rather than wait(): checkpoint() runs inside a signal handler, and a handler that
        # interrupts Popen.wait() could never take the Popen's wait lock itself.
        try:
            while (code := self._child.poll()) is None:
                time.sleep(0.05)
        finally:
            self._end_child()
        if code == EXIT_REQUEUE and env.global_rank == 0 and callable(previous):
            # The trainer was told to stop by a signal submitit did not see (e.g. SIGTERM at the
            # time limit): go through submitit's requeue path ourselves. It exits the process.
            previous(PREEMPT_SIGNAL, None)
        if code not in (0, EXIT_REQUEUE):
            raise HpcDdpError(f"trainer (rank {env.global_rank}) exited with code {code}")
        return self.summary(code)

    def _end_child(self) -> None:
        """A task leaving early (cancelled: submitit's SIGINT, a KeyboardInterrupt here) must
        not leave its trainer running: SIGTERM, on which it checkpoints and exits 75, then
        SIGKILL if it has not exited by the checkpoint deadline."""
        child = self._child
        if child is None or child.poll() is not None:
            return
        child.terminate()
        if not _exited(child.pid, CHILD_CHECKPOINT_TIMEOUT_S):
            child.kill()
        child.poll()  # reap it

    def summary(self, code: int) -> dict[str, Any]:
        """The exit code and the trainer's result.json: rank 0's return value, which
        submitit pickles for the submitter (a submitit task runs in the submitter's directory)."""
        return {"exit_code": code, **(read_result(trainer_run_paths(self.argv, os.getcwd())) or {})}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on rank 0 when preempted: let the trainer finish its checkpoint."""
        child = self._child
        if child is not None and not _exited(child.pid, CHILD_CHECKPOINT_TIMEOUT_S):
            child.kill()
        # The trainer resumes from the run dir's newest checkpoint: same task, same arguments.
        return submitit.helpers.DelayedSubmission(TrainTask(self.argv, self.python, self.env))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_child"] = None  # a process handle does not travel in a pickle
        return state


def _exited(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` has exited (zombie or gone), reading /proc: no Popen lock involved."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        if stat[stat.rfind(")") + 2 :].split()[0] in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False
