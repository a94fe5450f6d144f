"""``FunctionTask``: any Python function as a submitit task, with the distributed environment set.

Before ``fn`` runs, each task exports the spec's environment and the variables
``init_process_group(init_method="env://")`` reads (``hpc_ddp.deploy.submitit.environment``, as
for a program). With ``distributed=True`` it also starts the process group
(``hpc_ddp.init_distributed``: GPU bound, every rank met within a deadline).

Preemption and time limit: submitit's own handler (USR2) calls ``checkpoint()`` on rank 0, which
``Checkpointable`` answers with the same call; submitit requeues it. ``fn`` is therefore run again
from its start: a function that wants to resume keeps its progress with ``hpc_ddp.Checkpointer``
in a directory it names and finds it there on restart.
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from typing import Any

import submitit

from hpc_ddp.deploy.submitit.environment import export_task_env
from hpc_ddp.deploy.submitit.requeue import ignore_sigterm_before_requeue


class FunctionTask(submitit.helpers.Checkpointable):
    """Call ``fn(*args, **kwargs)`` in every task of a submitit job; requeued when preempted."""

    def __init__(
        self, fn: Callable[..., Any], env: dict[str, str] | None = None, distributed: bool = False
    ) -> None:
        self.fn = fn
        self.env = dict(env or {})
        self.distributed = distributed

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        dist_env = export_task_env(self.env)
        if not self.distributed:
            return self.fn(*args, **kwargs)
        from hpc_ddp.dist import init_distributed  # torch: only when a process group is asked for

        init_distributed(dist_env)  # every rank connected when it returns
        # submitit pickles the return value after this method returns; the process then exits
        # through the interpreter's teardown, where Gloo can abort in a C++ destructor after the
        # work is done. Leave through os._exit instead, with the status the result pickle tells.
        atexit.register(_exit_by_outcome, submitit.JobEnvironment().paths.result_pickle)
        return self.fn(*args, **kwargs)

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on rank 0 when preempted: the same call again, requeued."""
        ignore_sigterm_before_requeue()
        return super().checkpoint(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionTask({getattr(self.fn, '__qualname__', self.fn)!r})"


def _exit_by_outcome(result_pickle: os.PathLike[str]) -> None:
    """Destroy the process group and leave: 0 if submitit pickled a success, else 1."""
    from hpc_ddp.dist import shutdown_and_exit

    try:
        ok = submitit.core.utils.pickle_load(result_pickle)[0] == "success"
    except Exception:  # no pickle: requeued (submitit exits -1) or killed; either is not success
        ok = False
    shutdown_and_exit(0 if ok else 1)
