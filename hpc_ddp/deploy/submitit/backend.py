"""The trainer through submitit: ``AutoExecutor`` on Slurm, ``LocalExecutor`` on this machine.

``TrainTask`` is a ``submitit.helpers.Checkpointable``. Each submitit task runs the trainer as a
child process (``python -m hpc_ddp.train``), for two reasons:

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

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import submitit

from hpc_ddp.deploy.sbatch.render import job_env
from hpc_ddp.deploy.sbatch.submit import LogFollower, result_lines
from hpc_ddp.deploy.spec import JobSpec, build_spec, time_limit_seconds
from hpc_ddp.deploy.submission_env import scrubbed_environ
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.exit_codes import EXIT_REQUEUE
from hpc_ddp.slurm_client import TERMINAL, SlurmClient

PREEMPT_SIGNAL = signal.SIGUSR2  # submitit's (SUBMITIT_PREEMPT_SIGNAL); trainer told explicitly
CHILD_CHECKPOINT_TIMEOUT_S = 120.0


def _run_dir(argv: list[str]) -> Path | None:
    for i, arg in enumerate(argv):
        if arg == "--run-dir" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--run-dir="):
            return Path(arg.split("=", 1)[1])
    return None


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
        while (code := self._child.poll()) is None:
            time.sleep(0.05)
        if code == EXIT_REQUEUE and env.global_rank == 0 and callable(previous):
            # The trainer was told to stop by a signal submitit did not see (e.g. SIGTERM at the
            # time limit): go through submitit's requeue path ourselves. It exits the process.
            previous(PREEMPT_SIGNAL, None)
        if code not in (0, EXIT_REQUEUE):
            raise HpcDdpError(f"trainer (rank {env.global_rank}) exited with code {code}")
        return self.summary(code)

    def summary(self, code: int) -> dict[str, Any]:
        out: dict[str, Any] = {"exit_code": code}
        run_dir = _run_dir(self.argv)
        if run_dir is not None and (run_dir / "result.json").exists():
            out.update(json.loads((run_dir / "result.json").read_text()))
        return out

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


def make_executor(
    spec: JobSpec,
    *,
    kind: str,
    folder: Path,
    cluster_env: Mapping[str, str] | None = None,
) -> submitit.Executor:
    """``kind`` "submitit" -> Slurm through AutoExecutor; "local" -> LocalExecutor."""
    if spec.launcher != "srun":
        raise ConfigError(
            "submitit starts one task per process itself: launcher must be srun",
            hint="drop launcher = 'torchrun' from the spec for --executor submitit/local",
        )
    minutes = max(1, _minutes(spec.time))
    common: dict[str, Any] = dict(
        timeout_min=minutes, tasks_per_node=spec.ppn, nodes=spec.nodes,
    )  # fmt: skip
    if kind == "local":
        if spec.nodes != 1:
            raise ConfigError(
                f"the local executor runs on one machine; the spec asks for {spec.nodes} nodes",
                hint="set nodes = 1 (and procs_per_node) or use --executor submitit",
            )
        ex = submitit.LocalExecutor(folder=str(folder))
        ex.update_parameters(
            timeout_min=minutes,
            tasks_per_node=spec.ppn,
            signal_delay_s=spec.signal_lead_s or 30,
        )
        return ex
    with scrubbed_environ(dict(cluster_env or {})):
        ex = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
    params: dict[str, Any] = dict(common, name=spec.name)
    if spec.gpus_per_node:
        params["gpus_per_node"] = spec.gpus_per_node
    if spec.cpus_per_task:
        params["cpus_per_task"] = spec.cpus_per_task
    if spec.partition:
        params["slurm_partition"] = spec.partition
    slurm_extra = {"signal_delay_s": spec.signal_lead_s or 90}
    if spec.account:
        slurm_extra["account"] = spec.account  # type: ignore[assignment]
    params.update({f"slurm_{k}": v for k, v in slurm_extra.items()})
    ex.update_parameters(**params)
    return ex


def _minutes(limit: str) -> int:
    secs = time_limit_seconds(limit)
    return 60 * 24 * 365 if secs is None else (secs + 59) // 60


def submit_train(
    spec: JobSpec,
    *,
    kind: str,
    folder: Path,
    cluster_env: Mapping[str, str] | None = None,
) -> submitit.Job[Any]:
    """Submit the trainer described by ``spec`` (its ``args`` are the trainer's flags)."""
    if spec.module != "hpc_ddp.train" or spec.script:
        raise ConfigError("the submitit backend runs the hpc_ddp trainer (module hpc_ddp.train)")
    folder.mkdir(parents=True, exist_ok=True)
    ex = make_executor(spec, kind=kind, folder=folder, cluster_env=cluster_env)
    # Same environment as the sbatch templates give (OMP_NUM_THREADS, GPUs per process...).
    task = TrainTask(list(spec.args), env=dict(job_env(spec)))
    # Submission from inside a job must not pass that job's SLURM_* sizing on (SLURM_CONF kept).
    with scrubbed_environ(dict(cluster_env or {})):
        return ex.submit(task)


def wait_submitit(
    job: submitit.Job[Any],
    *,
    timeout_s: float,
    cluster_env: Mapping[str, str] | None = None,
    follow: TextIO | None = None,
) -> tuple[str, int, Any]:
    """(state, exit code, rank 0's result) without sacct: result pickle or scontrol terminal state.

    submitit's own watcher asks sacct, which clusters without accounting (like the local one)
    do not answer, so a job that died before writing its result would be waited on forever.
    """
    client = SlurmClient({**os.environ, **(cluster_env or {})}) if cluster_env else None
    follower = LogFollower(Path(job.paths.stdout), follow)
    deadline = time.monotonic() + timeout_s
    state = "UNKNOWN"
    while True:
        follower.poll()
        if client is not None:
            info = client.job_info(str(job.job_id))
            state = info.get("JobState", state)
            if state in TERMINAL:
                break
        elif job.done():
            state = "COMPLETED" if job.paths.result_pickle.exists() else "FAILED"
            break
        if time.monotonic() > deadline:
            job.cancel(check=False)
            raise HpcDdpError(f"submitit job {job.job_id} not done after {timeout_s:.0f} s")
        time.sleep(0.2)
    follower.poll()
    try:
        result = job.results()[0]  # rank 0's: the trainer writes result.json there
    except Exception as err:  # submitit re-raises the task's error, with its traceback
        return state, 1, err
    code = int(result.get("exit_code", 0)) if isinstance(result, dict) else 0
    return state, code, result


def run_spec(
    spec_path: Path,
    *,
    executor: str,
    folder: Path | None,
    timeout_s: float,
    wait: bool,
    follow: TextIO | None,
    cluster_env: Mapping[str, str] | None,
) -> int:
    spec = build_spec(spec_path)
    folder = folder or Path("runs") / "submitit" / spec.name
    job = submit_train(spec, kind=executor, folder=folder, cluster_env=cluster_env)
    print(f"submitted {executor} job {job.job_id}; logs in {folder}", flush=True)
    if not wait:
        return 0
    state, code, result = wait_submitit(
        job, timeout_s=timeout_s, cluster_env=cluster_env, follow=follow
    )
    print(f"job {job.job_id}: {state}, exit code {code}")
    if isinstance(result, dict):
        print("\n".join(result_lines(result)))
    else:
        print(f"  error: {result}")
    return code
