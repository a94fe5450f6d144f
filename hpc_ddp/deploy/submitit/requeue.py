"""The requeue submitit runs after a task's ``checkpoint()``: its ``scontrol requeue`` must outlive
the SIGTERM that the requeue itself sends to the job.

submitit's handler on rank 0 calls ``checkpoint()`` and then runs ``scontrol requeue JOB`` in the
task's own process. slurmctld accepts the request and has slurmd SIGTERM every process of the job
while it answers, scontrol included. When the signal arrives first, scontrol dies before it
exits 0, submitit records the preempted attempt as failed, and the submitter's ``result()``
raises, though the job was requeued and its rerun succeeds. (The trainer's own requeue,
``runtime.preemption.requeue``, starts scontrol itself and blocks SIGTERM for that child only;
here submitit starts it after ``checkpoint()`` returns, so only the process-wide disposition can
reach it.)
"""

from __future__ import annotations

import signal


def ignore_sigterm_before_requeue() -> None:
    """Called at the end of ``checkpoint()``: an ignored signal stays ignored across exec, so the
    scontrol that submitit starts next ignores the job's SIGTERM and gets its answer. This
    process loses nothing: submitit only logs SIGTERM here, and it exits right after the
    requeue (Slurm's SIGKILL after KillWait still ends anything left)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
