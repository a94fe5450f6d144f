"""``ProgramTask``: what every submitit task runs for a spec, a ``submitit.helpers.Checkpointable``.

Each task exports the distributed environment (``hpc_ddp.deploy.submitit.environment``: the
spec's variables, then ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... as a torchrun worker gets
them) and runs the spec's program, ``python -u SCRIPT ARGS`` or ``python -u -m MODULE ARGS``, as a
child process, for two reasons:

* a DDP program leaves through ``os._exit`` (Gloo can abort in a C++ destructor at interpreter
  teardown, after the work is done), which would skip submitit's result pickle if it ran in
  submitit's process;
* the program checkpoints at a step boundary when its ranks agree, never inside a signal handler.

Preemption/time limit: the task forwards USR1, USR2 and TERM to its child (the LocalExecutor
signals only its task processes; on Slurm the child gets them from Slurm too, and a second
delivery only sets the same flag) and survives them itself. USR2 is submitit's warning: after
forwarding it, submitit's own handler runs, and on rank 0 calls ``checkpoint()``, which waits for
the child to finish its checkpoint and exit 75, then returns a ``DelayedSubmission`` of the same
task; submitit requeues the job, and the new run resumes from the program's newest checkpoint.
A child that exits 75 after another signal (USR1 from ``scancel --signal=USR1``, TERM at the
time limit) goes through the same requeue path from rank 0. Exit 0 ends the task normally;
any other code is an error submitit records. A program with a hook (hpc_ddp.deploy.program;
the project's trainer) is told these signals and that submitit owns the requeue, and rank 0
returns its result.json: what its hook said is fixed in the task when the job is described, so
a task never looks for a hook where it runs. Only this module's process is submitit's; it never
imports torch.
"""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import submitit

from hpc_ddp.deploy.backend import read_result
from hpc_ddp.deploy.submitit.environment import export_task_env
from hpc_ddp.deploy.submitit.requeue import ignore_sigterm_before_requeue
from hpc_ddp.errors import HpcDdpError
from hpc_ddp.exit_codes import EXIT_REQUEUE
from hpc_ddp.polling import poll_until
from hpc_ddp.run_dir.paths import RunPaths

PREEMPT_SIGNAL = signal.SIGUSR2  # submitit's (SUBMITIT_PREEMPT_SIGNAL)
# What a task passes on to its program: Slurm's usual warning, submitit's, and the time limit's.
FORWARDED_SIGNALS = (signal.SIGUSR1, PREEMPT_SIGNAL, signal.SIGTERM)
CHILD_CHECKPOINT_TIMEOUT_S = 120.0

Handler = Callable[[int, FrameType | None], Any]


@dataclass
class ProgramTask(submitit.helpers.Checkpointable):
    """Run ``python -u PROGRAM`` in every submitit task; ``program`` is a spec's ``program``
    (``[SCRIPT, *ARGS]`` or ``["-m", MODULE, *ARGS]``), with what the program's hook adds for
    submitit. Resumable: requeued on preemption."""

    program: list[str]
    env: dict[str, str] = field(default_factory=dict)
    python: str = sys.executable
    # The run dir whose result.json rank 0 returns, absolute (None: the program keeps its own)
    # and how errors name the program ("": its script, or -m MODULE); both from its hook.
    run_dir: str | None = None
    label: str = ""
    _child: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _signalled: int = field(default=PREEMPT_SIGNAL, init=False, repr=False)  # the last passed on

    def command(self) -> list[str]:
        return [self.python, "-u", *self.program]

    @property
    def name(self) -> str:
        """How an error names the program: its hook's name, its script, or ``-m MODULE``."""
        if self.label:
            return self.label
        return " ".join(self.program[:2] if self.program[:1] == ["-m"] else self.program[:1])

    @property
    def module(self) -> str | None:
        """The module it runs (``python -m``), None for a script."""
        return self.program[1] if self.program[:1] == ["-m"] and len(self.program) > 1 else None

    def run_paths(self) -> RunPaths | None:
        """The run dir whose result.json the job reports."""
        return None if self.run_dir is None else RunPaths(self.run_dir)

    def summary(self, code: int) -> dict[str, Any]:
        """Rank 0's return value, which submitit pickles for the submitter: the exit code, and
        the program's result.json where it has a run dir."""
        return {"exit_code": code, **(read_result(self.run_paths()) or {})}

    def __call__(self) -> dict[str, Any]:
        rank = submitit.JobEnvironment().global_rank
        previous = {sig: self._forward(sig) for sig in FORWARDED_SIGNALS}
        export_task_env(self.env)  # inherited by the child
        child = self._child = subprocess.Popen(self.command())
        # Poll rather than wait(): checkpoint() runs inside a signal handler, and a handler that
        # interrupts Popen.wait() could never take the Popen's wait lock itself.
        try:
            poll_until(lambda: child.poll() is not None, None, interval_s=0.05)
        finally:
            self._end_child()
        code = child.returncode
        requeue = previous[PREEMPT_SIGNAL]  # submitit's handler
        if code == EXIT_REQUEUE and rank == 0 and callable(requeue):
            # The program was stopped by a signal submitit's handler did not see (USR1, TERM):
            # go through submitit's requeue path ourselves, naming that signal in its log. It
            # exits the process.
            requeue(self._signalled, None)
        if code not in (0, EXIT_REQUEUE):
            raise HpcDdpError(f"{self.name} (rank {rank}) exited with code {code}")
        return self.summary(code)

    def _forward(self, sig: signal.Signals) -> object:
        """Pass ``sig`` to the child, then to the handler that was there (submitit's, for USR2
        and TERM); a default action (USR1 would end this process) is not taken. Returns it."""
        previous = signal.getsignal(sig)

        def forward(signum: int, frame: FrameType | None) -> None:
            self._signalled = signum
            if self._child is not None and self._child.poll() is None:
                self._child.send_signal(signum)
            if callable(previous):
                previous(signum, frame)  # USR2: rank 0 calls checkpoint() and requeues

        signal.signal(sig, forward)
        return previous

    def _end_child(self) -> None:
        """A task leaving early (cancelled: submitit's SIGINT, a KeyboardInterrupt here) must
        not leave its program running: SIGTERM, on which it checkpoints and exits 75, then
        SIGKILL if it has not exited by the checkpoint deadline."""
        child = self._child
        if child is None or child.poll() is not None:
            return
        child.terminate()
        if not _exited(child.pid, CHILD_CHECKPOINT_TIMEOUT_S):
            child.kill()
        child.poll()  # reap it

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on rank 0 when preempted: let the program finish its checkpoint."""
        child = self._child
        if child is not None and not _exited(child.pid, CHILD_CHECKPOINT_TIMEOUT_S):
            child.kill()
        ignore_sigterm_before_requeue()  # the program has left: nothing to forward it to
        # The program resumes from its newest checkpoint: same task, same arguments.
        return submitit.helpers.DelayedSubmission(dataclasses.replace(self))

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_child"] = None  # a process handle does not travel in a pickle
        return state


def _exited(pid: int, timeout_s: float) -> bool:
    """Wait until ``pid`` has exited (zombie or gone), reading /proc: no Popen lock involved."""

    def exited() -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return True
        return stat[stat.rfind(")") + 2 :].split()[0] in ("Z", "X")

    return bool(poll_until(exited, timeout_s, interval_s=0.05))
