"""Job control after submission: find a job again, say how it stands, show its logs, stop it.

``attach_job`` re-creates the handle ``submit`` returned (a ``SlurmJob`` or a ``SubmititJob``) from
what outlives the submitting process: Slurm's record of the job (``scontrol show job``, the
batch script Slurm keeps) and, for submitit, its job folder (logs and pickles). ``job_report``,
``log_paths``/``follow_logs`` and ``cancel_job`` work on any such handle, so ``hpc-ddp status``,
``logs`` and ``cancel`` behave the same for sbatch and submitit jobs. A submitit folder's pickles
are loaded only where nobody else could have written them (``submitit.pickles``): the folder
may be another user's, named by Slurm's record of their job; otherwise the job is reported from
Slurm's answer and /proc, and the report's notes say which pickle was not read and why.

Stopping without ``now`` is a checkpoint, then an end: the preemption signal goes to the
processes that checkpoint on it, and once the job has left RUNNING (the trainer checkpointed and
asked Slurm for a requeue, or ended) whatever is left of it is cancelled, so it never runs again.
Torch-free; submitit is imported only for submitit jobs.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from hpc_ddp import regular_file
from hpc_ddp.deploy.backend import Job, read_result
from hpc_ddp.deploy.core import TRAIN_MODULE
from hpc_ddp.deploy.executors import EXECUTORS
from hpc_ddp.deploy.program import program_in_script, result_lines
from hpc_ddp.deploy.safe_text import comment_text
from hpc_ddp.deploy.sbatch.submit import LogFollower
from hpc_ddp.deploy.submission_env import submission_env
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.polling import poll_until
from hpc_ddp.run_dir.paths import PROGRESS_SLURM_JOB, RunPaths
from hpc_ddp.slurm_client import (
    MAX_RESTARTS,
    TERMINAL,
    LostJobWatch,
    SlurmClient,
    is_job_id,
    restarts,
)

# `#SBATCH --signal=[B:]SIG[@SECONDS]`: the warning the job's script asks Slurm for.
_SIGNAL_DIRECTIVE = re.compile(r"^#SBATCH\s+--signal[= ](?:[BR]+:)?(?:SIG)?([A-Z0-9]+)", re.M)
# The most of a batch script read back: sbatch refuses larger ones unless a site raises its
# max_script_size (SchedulerParameters, 4 MB by default).
SCRIPT_LIMIT = 4 << 20
# The signal a stop sends a batch job whose script and program name none (a JobSpec's default).
_USUAL_SIGNAL = "USR1"
# How long a stop waits for the checkpoint before it cancels for good (the trainer's own
# checkpoint deadline on a signal is 120 s).
STOP_TIMEOUT_S = 300.0


def check_job_id(job_id: str) -> str:
    """``job_id`` if it names one job (a Slurm job, an array task: 12_3, or a local submitit
    job: its controller's pid), else a ConfigError saying why."""
    hint = "give the number `hpc-ddp submit` printed (or squeue shows)"
    if set(job_id.partition("_")[0]) == {"0"}:
        raise ConfigError(f"job id {job_id!r} is job 0, which Slurm reads as every job", hint=hint)
    if not is_job_id(job_id):
        raise ConfigError(f"{job_id!r} is not a job id", hint=hint)
    return job_id


def attach_job(
    job_id: str,
    *,
    folder: str | Path | None = None,
    cluster_env: Mapping[str, str] | None = None,
) -> Job:
    """The handle of a submitted job. ``folder``: a submitit job's folder (needed for a local
    job, whose id is its controller's pid; found from Slurm's record otherwise). ``cluster_env``:
    the Slurm to ask (None: this environment's)."""
    job_id = check_job_id(str(job_id))
    if folder is not None and is_local_job(Path(folder), job_id):
        from hpc_ddp.deploy.submitit.local_jobs import controller_cwd

        return _submitit_job(job_id, Path(folder), None, controller_cwd(job_id))
    env = dict(cluster_env or {})
    client = SlurmClient({**submission_env(), **env})
    info = client.job_info(job_id)
    if not info:
        where = f" and {folder} holds no submitit job {job_id}" if folder else ""
        raise HpcDdpError(
            f"Slurm does not know job {job_id}{where}",
            hint="check the id (squeue); a job that ended long ago is forgotten (MinJobAge); "
            "a local submitit job needs --folder",
        )
    stdout = Path(info["StdOut"]) if info.get("StdOut") else None
    script = batch_script(client, job_id, info)
    if stdout is not None and "submitit" in script and stdout.name.endswith("_log.out"):
        workdir = Path(info.get("WorkDir") or ".")
        return _submitit_job(job_id, Path(folder) if folder else stdout.parent, env, workdir)
    from hpc_ddp.deploy.sbatch.backend import SlurmJob

    found = program_in_script(script)
    workdir = Path(info.get("WorkDir") or ".")
    if found is None:
        return SlurmJob(job_id, env, stdout)
    run_paths = found.hook.run_paths(found.args, workdir)
    return SlurmJob(job_id, env, stdout, run_paths, program=found.module)


def batch_script(client: SlurmClient, job_id: str, info: Mapping[str, str]) -> str:
    """The job's batch script as Slurm keeps it ('' once it is gone)."""
    proc = client.run(["scontrol", "write", "batch_script", job_id, "-"], check=False)
    if proc.returncode == 0 and proc.stdout:
        return proc.stdout
    # The file it was submitted from, if it is still there: a path that anyone's job names
    # (scontrol refuses another user's batch script), so read as a regular file only, bounded.
    command = info.get("Command", "")
    return _read_script(Path(command), follow_symlinks=True) if command else ""


def _read_script(path: Path, *, follow_symlinks: bool = False) -> str:
    """A batch script's text; '' for what is missing, unreadable or no regular file (a FIFO
    would block the read, a link to /dev/zero never end it)."""
    try:
        data = regular_file.read_small(path, SCRIPT_LIMIT, follow_symlinks=follow_symlinks)
    except OSError:
        return ""
    return data.decode(errors="replace")


def is_local_job(folder: str | Path, job_id: str) -> bool:
    """A LocalExecutor job: its pickle is there and its submission file is no sbatch script."""
    folder = Path(folder)
    if not (folder / f"{job_id}_submitted.pkl").is_file():
        return False
    return "#SBATCH" not in _read_script(folder / f"{job_id}_submission.sh")


def _submitit_job(
    job_id: str, folder: Path, cluster_env: Mapping[str, str] | None, workdir: Path
) -> Job:
    """submitit's own handle re-created from its folder; the run dir from the task's pickle
    (a submitit task runs in the submitter's directory, ``workdir``), if it may be loaded."""
    import submitit

    from hpc_ddp.deploy.submitit.backend import SubmititJob

    if cluster_env is None:
        handle: Any = submitit.local.local.LocalJob(folder, job_id)
    else:
        handle = submitit.SlurmJob(folder, job_id)
    job = SubmititJob(handle, cluster_env, None, None, folder)
    # The submitted call, when it is a program's task, knows its program and the run dir its
    # hook gave (refusals in job.notes); an Executor's function task knows neither.
    with contextlib.suppress(AttributeError, OSError, ConfigError):
        task = job.read_pickle(handle.paths.submitted_pickle).function
        job.program, job.run_paths = task.module, task.run_paths()
    return job


# --- status ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobReport:
    """How a job stands: Slurm's view, and the program's (progress.json, result.json)."""

    job_id: str
    executor: str
    state: str
    restarts: int = 0
    nodes: str = ""
    reason: str = ""
    run_dir: Path | None = None
    progress: Mapping[str, Any] | None = None
    result: Mapping[str, Any] | None = None
    logs: tuple[Path, ...] = field(default_factory=tuple)
    notes: tuple[str, ...] = ()  # what was not read, and why
    program: str | None = None  # the module the job runs (python -m), whose hook shows result

    def lines(self) -> list[str]:
        out = [f"job {self.job_id} ({self.executor}): {self.state}, restarts {self.restarts}"]
        if self.nodes:
            out.append(f"  nodes: {self.nodes}")
        if self.reason and self.reason != "None":
            out.append(f"  reason: {self.reason}")
        out += [f"  log: {path}" for path in self.logs]
        if self.run_dir is not None:
            out.append(f"  run dir: {self.run_dir}")
        if self.progress:
            out.append("  progress: " + progress_text(self.progress))
        if self.result:
            shown = result_lines(self.result, self.program)
            out += ["  result:", *("  " + line for line in shown)]
        out += [f"  note: {note}" for note in self.notes]
        # The run dir's files, log names and Slurm's fields are anyone's text: a terminal escape
        # or line break in them is shown escaped, never acted on.
        return [comment_text(line) for line in out]


def progress_text(progress: Mapping[str, Any]) -> str:
    """One line from progress.json: its scalar fields, in the trainer's order."""
    return ", ".join(
        f"{key} {value}" for key, value in progress.items() if isinstance(value, str | int | float)
    )


def read_progress(run_paths: RunPaths | None) -> dict[str, Any] | None:
    if run_paths is None:
        return None
    try:
        data = regular_file.read_json(run_paths.progress)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def job_report(job: Job) -> JobReport:
    """State, requeues, nodes, the trainer's progress and result of ``job``."""
    info = _slurm_info(job)
    state = info.get("JobState") or job.status()
    run_paths = job.run_paths
    return JobReport(
        job.job_id,
        job.executor,
        state,
        restarts(info) if info else 0,
        info.get("NodeList", "") if info.get("NodeList") != "(null)" else "",
        info.get("Reason", ""),
        run_paths.root if run_paths else None,
        read_progress(run_paths),
        read_result(run_paths),
        tuple(log_paths(job)),
        tuple(getattr(job, "notes", ())),
        job.program,
    )


def run_dir_report(run_dir: Path, *, program: str | None = TRAIN_MODULE) -> JobReport:
    """What a run dir alone says, for a run whose job Slurm no longer knows (or never ran in
    Slurm): ENDED once result.json exists, else UNKNOWN; the job and its restarts as the run
    recorded them. ``program``: the module whose run dir it is (python -m; a spec's default,
    the trainer, unless told), whose hook shows its result."""
    paths = RunPaths(run_dir)
    result, progress = read_result(paths), read_progress(paths)
    job_id = _run_dir_job(paths, progress)
    recorded = _recorded_job(progress)
    # The restarts of the attempt that last wrote progress.json, if that was this job's.
    count = recorded[1] if recorded is not None and recorded[0] == job_id else 0
    state = "ENDED" if result is not None else "UNKNOWN"
    return JobReport(job_id or "?", "run dir", state, count, run_dir=paths.root,
                     progress=progress, result=result, program=program)  # fmt: skip


def run_dir_job(run_dir: Path) -> str | None:
    """The Slurm job id of the run that holds ``run_dir``'s lock, else of the last that wrote
    its progress.json, if known."""
    paths = RunPaths(run_dir)
    return _run_dir_job(paths, read_progress(paths))


def _run_dir_job(paths: RunPaths, progress: Mapping[str, Any] | None) -> str | None:
    # The lock's owner file names the live run's job; it goes when the run ends.
    try:
        owner = regular_file.read_json(paths.lock_owner)
    except (OSError, ValueError):
        owner = None
    job_id = owner.get("job_id") if isinstance(owner, dict) else None
    if isinstance(job_id, str) and is_job_id(job_id):
        return job_id
    recorded = _recorded_job(progress)
    return recorded[0] if recorded is not None else None


def _recorded_job(progress: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """(job id, restarts) that progress.json records of the Slurm job that wrote it."""
    record = progress.get(PROGRESS_SLURM_JOB) if progress else None
    if not isinstance(record, dict):
        return None
    job_id, count = record.get("id"), record.get("restarts")
    if not (isinstance(job_id, str) and is_job_id(job_id)):
        return None
    if type(count) is not int or not 0 <= count <= MAX_RESTARTS:
        return None
    return job_id, count


def _slurm_info(job: Job) -> dict[str, str]:
    client = _client(job)
    return client.job_info(job.job_id) if client is not None else {}


def _client(job: Job) -> SlurmClient | None:
    env = getattr(job, "cluster_env", None)
    if env is None:
        return None
    return SlurmClient({**submission_env(), **env})


# --- logs -----------------------------------------------------------------------------------
def log_paths(job: Job) -> list[Path]:
    """The batch log and every rank's log, those that exist (submitit: every task's). What is
    at such a name is only read if it is a regular file (``follow_logs``)."""
    folder = getattr(job, "folder", None)
    if folder is not None and EXECUTORS[job.executor].submitit:
        found = sorted(Path(folder).glob(f"{job.job_id}_*_log.out"))
        return found + sorted(Path(folder).glob(f"{job.job_id}_*_log.err"))
    if job.output is None:
        return []
    out = job.output
    ranks = sorted(out.parent.glob(f"{out.name}.rank*"), key=_rank_of)
    return [p for p in [out, *ranks] if p.exists()]


def _rank_of(path: Path) -> int:
    tail = path.name.rpartition(".rank")[2]
    return int(tail) if tail.isdigit() else 0


def follow_logs(
    job: Job,
    sink: TextIO,
    *,
    follow: bool = False,
    timeout_s: float | None = None,
    interval_s: float = 0.2,
) -> None:
    """Write the job's logs to ``sink``, each under a ``==> path <==`` header; with ``follow``,
    keep writing what is appended (new rank logs included) until the job has ended or
    ``timeout_s`` has passed. Each log is read in bounded chunks (``LogFollower``), its last
    line at the end whether or not a line break ends it. Raises HpcDdpError, after writing what
    the logs hold: for a log that is no regular file (a FIFO, a device, a link to one: not
    read), and once Slurm has stopped knowing the job (``LostJobWatch``): following it would
    never end."""
    out = _Headers(sink)
    followers: dict[Path, LogFollower] = {}
    lost = LostJobWatch(job.job_id)

    def show(final: bool) -> None:
        for path in log_paths(job):
            if path not in followers:
                followers[path] = LogFollower(path, out.under(path), say_refusal=False)
            followers[path].poll(final=final)

    def ended() -> bool:
        state = job.status()
        if state in TERMINAL:
            return True
        show(final=False)
        lost.answer(state)
        return False

    if follow:
        poll_until(ended, timeout_s, interval_s)
    show(final=True)
    refused = [f.refusal() for f in followers.values() if f.refused is not None]
    if refused:
        raise HpcDdpError(
            f"not shown, not a log the job wrote: {'; '.join(refused)}",
            hint="a job's log is a regular file; something else was put at that name (in a "
            "shared directory, by someone else?): remove it, then run `hpc-ddp logs` again",
        )


class _Headers:
    """``follow_logs``'s output: each log's text under a ``==> path <==`` header, written again
    whenever the text before came from another log."""

    def __init__(self, sink: TextIO) -> None:
        self.sink = sink
        self.last: Path | None = None
        self.mid_line = False  # the last log's last line had no line break (yet)

    def under(self, path: Path) -> _Under:
        return _Under(self, path)


class _Under:
    """The sink of one log's ``LogFollower``."""

    def __init__(self, headers: _Headers, path: Path) -> None:
        self.headers, self.path = headers, path

    def write(self, text: str) -> None:
        if not text:
            return
        out = self.headers
        if out.last != self.path:
            out.sink.write(
                ("\n" if out.mid_line else "") + f"==> {comment_text(str(self.path))} <==\n"
            )
            out.last = self.path
        out.sink.write(text)
        out.mid_line = not text.endswith("\n")

    def flush(self) -> None:
        self.headers.sink.flush()


# --- cancel ---------------------------------------------------------------------------------
def preemption_signal(job: Job, script: str) -> str:
    """The signal on which ``job``'s processes checkpoint: submitit's USR2; for a batch script,
    its ``#SBATCH --signal``, else the first signal its program's hook names (the trainer's:
    USR1), else USR1, Slurm's usual warning."""
    if EXECUTORS[job.executor].submitit:
        from hpc_ddp.deploy.submitit.task import PREEMPT_SIGNAL

        return PREEMPT_SIGNAL.name.removeprefix("SIG")
    if found := _SIGNAL_DIRECTIVE.search(script):
        return found.group(1)
    program = program_in_script(script)
    signals = program.hook.flags(program.args).signals if program is not None else None
    return signals[0] if signals else _USUAL_SIGNAL


def cancel_job(
    job: Job,
    *,
    now: bool = False,
    timeout_s: float = STOP_TIMEOUT_S,
    on_event: Callable[[str], None] = lambda _msg: None,
) -> str:
    """End ``job``; returns its final state. Without ``now``: the preemption signal first, so
    the trainer checkpoints; once the job has left RUNNING it is cancelled for good (a
    requeued job never runs again); at ``timeout_s`` it is cancelled whatever it does. With
    ``now``: SIGKILL to every process of it, no checkpoint."""
    if job.status() in TERMINAL:
        return job.status()
    if EXECUTORS[job.executor].this_machine:
        from hpc_ddp.deploy.submitit.local_jobs import stop_local

        return stop_local(job, now=now, timeout_s=timeout_s, on_event=on_event)
    client = _client(job)
    assert client is not None  # every other job is a Slurm job
    if now:
        # SIGKILL to each step itself: for the job as a whole, Slurm's KILL is a cancel, which
        # sends TERM first, and the trainer checkpoints (and requeues) on TERM.
        on_event(f"job {job.job_id}: SIGKILL to every step, then cancelling the job")
        for step in _steps(client, job.job_id):
            client.run(["scancel", "--signal=KILL", step], check=False)
        client.cancel(job.job_id)
        return _settled(job, 60)
    info = client.job_info(job.job_id)
    sig = preemption_signal(job, batch_script(client, job.job_id, info))
    before = restarts(info)
    if job.status() == "RUNNING":
        on_event(f"job {job.job_id}: SIG{sig} to its tasks, waiting for the checkpoint")
        client.run(["scancel", f"--signal={sig}", job.job_id], check=False)
        _wait_left_running(client, job.job_id, before, timeout_s)
    info = client.job_info(job.job_id)
    if info.get("JobState") not in TERMINAL:
        requeued = restarts(info) > before
        on_event(
            f"job {job.job_id}: " + ("requeued itself; " if requeued else "") + "cancelling it"
        )
        client.cancel(job.job_id)
    return _settled(job, 60)


def _steps(client: SlurmClient, job_id: str) -> list[str]:
    """The job's running steps (JOB.0, JOB.1...), not its batch or extern step."""
    proc = client.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i"], check=False)
    return [s for s in proc.stdout.split() if re.fullmatch(re.escape(job_id) + r"\.[0-9]+", s)]


def _wait_left_running(client: SlurmClient, job_id: str, before: int, timeout_s: float) -> None:
    """Until the job is no longer RUNNING (or was requeued: PENDING again), or the deadline."""

    def left_running() -> bool:
        info = client.job_info(job_id)
        return info.get("JobState") != "RUNNING" or restarts(info) > before

    poll_until(left_running, timeout_s)


def _settled(job: Job, timeout_s: float) -> str:
    state = ""

    def ended() -> bool:
        nonlocal state
        state = job.status()
        return state in TERMINAL

    if not poll_until(ended, timeout_s, interval_s=0.2):
        raise HpcDdpError(
            f"job {job.job_id} still {state} {timeout_s:.0f} s after it was cancelled",
            hint="look at `scontrol show job` and the nodes' slurmd logs",
        )
    return state
