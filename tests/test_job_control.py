"""``hpc-ddp status``, ``logs`` and ``cancel`` on real jobs: sbatch jobs on the real local Slurm
(real sbatch, scancel, scontrol requeue), a submitit LocalExecutor job on this machine.

A trainer held at step 3 (``--debug-hold-at-step``: it waits there for a preemption signal)
gives each test a running job in a known place: checkpoints exist for step 2 (every 2 steps),
and a checkpoint of step 3 exists only if the trainer was told to checkpoint.

The hostile cases (docs/security.md, "Job control") use the real user ``nobody`` as the other
user (the suite runs as root), pickles whose loading would run ``touch`` on a canary file, real
FIFOs and device nodes, and a real process that the toolkit did not start.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_support import progress_status, submit_spec, train_args, train_spec
from hostile_files import evil_pickle, make_fifo, run_child, symlink_to

import hpc_ddp
from hpc_ddp.deploy import JobSpec
from hpc_ddp.deploy.submitit.backend import RESULT_LAG_S, RESULT_LAG_UNSURE_S, result_lag
from hpc_ddp.deploy.submitit.local_jobs import children
from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm import wait_for
from hpc_ddp.slurm_client import TERMINAL

HOLD = ("--debug-hold-at-step", "3")
NOBODY_UID = 65534


def _hpc_ddp(args: list[str], env: dict[str, str], **kw: object) -> subprocess.Popen[str]:
    full = {**os.environ, **env, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.Popen(
        [sys.executable, "-m", "hpc_ddp.cli", *args],
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kw,  # type: ignore[arg-type]
    )


def _run(
    args: list[str], env: dict[str, str], timeout_s: float = 240, rc: int = 0
) -> tuple[str, str]:
    """``hpc-ddp ARGS``'s (stdout, stderr); it must exit ``rc`` within ``timeout_s`` (a read
    that blocks fails the test with TimeoutExpired)."""
    proc = _hpc_ddp(args, env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    assert proc.returncode == rc, (args, out, err)
    return out, err


def _latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


@pytest.mark.slurm
@pytest.mark.slow
def test_status_logs_cancel_sbatch_jobs(slurm_cluster, tmp_path: Path) -> None:
    """Two held jobs at once: one is cancelled with a checkpoint (USR1, the trainer checkpoints
    and requeues itself, the requeued job is cancelled before it runs again), one with --now."""
    env = slurm_cluster.env
    jobs = {}
    # ctl-now asks nothing of a second node: one node, two fewer torch processes.
    for name, nodes in (("ctl-ckpt", 2), ("ctl-now", 1)):
        cwd = tmp_path / name
        cwd.mkdir()
        spec = train_spec(name, per_rank_logs=True, nodes=nodes)
        spec = spec.replace(args=[*spec.args, *HOLD])
        jobs[name] = (cwd, *submit_spec(spec, cwd, env))
    for name, (cwd, _, _) in jobs.items():
        wait_for(lambda c=cwd: progress_status(c / "run") == "holding", 120, f"{name} holding")

    cwd, job_id, out = jobs["ctl-ckpt"]
    status, _ = _run(["status", job_id], env)
    assert f"job {job_id} (sbatch): RUNNING, restarts 0" in status, status
    assert "nodes: node[1-2]" in status and "status holding" in status, status
    assert f"run dir: {cwd / 'run'}" in status, status
    by_dir, _ = _run(["status", str(cwd / "run")], env)  # the run dir's lock names the job
    assert f"job {job_id} (sbatch): RUNNING" in by_dir, by_dir
    logs, _ = _run(["logs", job_id], env)
    assert f"==> {out} <==" in logs and f"job {job_id} restart 0 " in logs, logs
    assert f"==> {out}.rank0 <==" in logs, logs  # the rank logs too (rank 0 logs the run)
    follower = _hpc_ddp(["logs", "-f", job_id, "--timeout", "200"], env)

    _, said = _run(["cancel", job_id], env)
    assert "SIGUSR1 to its tasks" in said and "requeued itself; cancelling it" in said, said
    assert slurm_cluster.job_state(job_id) == "CANCELLED"
    assert _latest(cwd / "run") == "step-00000003"  # the cancel's checkpoint
    # -f stopped by itself once the job ended, having printed what came after it started: the
    # tasks' exit 75 (checkpointed, requeue asked) is written after the cancel began.
    followed, _ = follower.communicate(timeout=60)
    assert follower.returncode == 0 and "Exited with exit code 75" in followed, followed
    assert "restart 1" not in out.read_text()  # cancelled while pending: it never ran again
    ended, _ = _run(["status", job_id], env)
    assert f"job {job_id} (sbatch): CANCELLED, restarts 1" in ended, ended
    # The run has ended and its lock's owner file is gone: progress.json names the job.
    by_dir, _ = _run(["status", str(cwd / "run")], env)
    assert f"job {job_id} (sbatch): CANCELLED, restarts 1" in by_dir, by_dir

    cwd, job_id, out = jobs["ctl-now"]
    _, said = _run(["cancel", "--now", job_id], env)
    assert "SIGKILL to every step" in said, said
    assert slurm_cluster.job_state(job_id) in TERMINAL
    assert _latest(cwd / "run") == "step-00000002"  # killed: no checkpoint of the hold step
    assert "restart 1" not in out.read_text()


def test_status_and_cancel_local_submitit_job(tmp_path: Path) -> None:
    """A LocalExecutor job found again from its folder (as another process would: a new handle
    without submitit's Popen), then cancelled: the trainer checkpoints, the job ends."""
    (tmp_path / "data").mkdir()
    args = train_args(str(tmp_path / "data"), str(tmp_path / "run"), *HOLD)
    spec = JobSpec(name="ctl-local", nodes=1, procs_per_node=2, time="5", args=args)
    folder = tmp_path / "submitit"
    submitted = hpc_ddp.submit(spec, "local", folder=folder, wait=False)
    wait_for(lambda: progress_status(tmp_path / "run") == "holding", 120, "trainer holding")
    status, _ = _run(["status", submitted.job_id, "--folder", str(folder)], {})
    assert f"job {submitted.job_id} (local): RUNNING" in status, status
    assert f"run dir: {tmp_path / 'run'}" in status and "status holding" in status, status

    job = hpc_ddp.attach_job(submitted.job_id, folder=folder)
    assert hpc_ddp.log_paths(job)[0] == folder / f"{submitted.job_id}_0_log.out"
    assert hpc_ddp.cancel_job(job, timeout_s=120) == "CANCELLED"
    assert _latest(tmp_path / "run") == "step-00000003"
    again = hpc_ddp.job_report(hpc_ddp.attach_job(submitted.job_id, folder=folder))
    assert again.state == "CANCELLED", again

    # Hostile files in submitit's folder, which may be shared: a FIFO as task 0's log and as
    # the submission file (each read blocked for ever), a link to /dev/zero as task 1's log.
    prefix = f"{folder / submitted.job_id}"
    make_fifo(Path(f"{prefix}_0_log.out"))
    symlink_to(Path(f"{prefix}_1_log.out"), "/dev/zero")
    target = [submitted.job_id, "--folder", str(folder)]
    logs, said = _run(["logs", *target], {}, timeout_s=60, rc=2)
    assert f"==> {prefix}_0_log.err <==" in logs, logs  # the readable logs, first
    assert f"{prefix}_0_log.out: a FIFO, not a regular file" in said, said
    assert f"{prefix}_1_log.out: a character device, not a regular file" in said, said
    make_fifo(Path(f"{prefix}_submission.sh"))
    status, _ = _run(["status", *target], {}, timeout_s=60)
    assert f"job {submitted.job_id} (local): CANCELLED" in status, status


@pytest.mark.slurm
@pytest.mark.slow
def test_status_logs_cancel_submitit_job_on_slurm(slurm_cluster, tmp_path: Path) -> None:
    """A submitit (AutoExecutor) job found from its id alone: Slurm's record names its folder.
    cancel sends submitit's USR2; submitit's handler checkpoints and requeues; the requeued job
    is cancelled before it runs again."""
    env = slurm_cluster.env
    (tmp_path / "data").mkdir()
    args = train_args(str(tmp_path / "data"), str(tmp_path / "run"), *HOLD)
    spec = JobSpec(name="ctl-sub", nodes=1, procs_per_node=2, time="30", args=args)
    folder = tmp_path / "submitit"
    job = hpc_ddp.submit(spec, "submitit", folder=folder, cluster_env=env, wait=False)
    wait_for(lambda: progress_status(tmp_path / "run") == "holding", 120, "trainer holding")
    status, _ = _run(["status", job.job_id], env)
    assert f"job {job.job_id} (submitit): RUNNING, restarts 0" in status, status
    assert f"run dir: {tmp_path / 'run'}" in status and "status holding" in status, status
    logs, _ = _run(["logs", job.job_id], env)
    assert f"==> {folder / f'{job.job_id}_0_log.out'} <==" in logs, logs
    _, said = _run(["cancel", job.job_id], env)
    assert "SIGUSR2 to its tasks" in said and "requeued itself; cancelling it" in said, said
    assert slurm_cluster.job_state(job.job_id) == "CANCELLED"
    assert _latest(tmp_path / "run") == "step-00000003"


@pytest.mark.slurm
def test_a_submitit_job_killed_without_a_result_ends_the_waiting_submit(
    slurm_cluster, tmp_path: Path
) -> None:
    """`cancel --now` SIGKILLs the task before submitit can pickle a result. The waiting
    `hpc-ddp submit --executor submitit` must end, saying so; submitit's own `results()` waits
    for that pickle until sacct (which the embedded cluster lacks) says the job ended."""
    env = slurm_cluster.env
    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import pathlib, time\npathlib.Path('started').touch()\ntime.sleep(600)\n")
    spec = tmp_path / "sleeper.toml"
    spec.write_text(
        f'name = "killed-sub"\nnodes = 1\nprocs_per_node = 1\ntime = "10"\nscript = "{sleeper}"\n'
    )
    folder = tmp_path / "submitit"
    submit = _hpc_ddp(
        ["submit", "--executor", "submitit", "--folder", str(folder), "--quiet",
         "--wait-timeout", "300", str(spec)],
        env, cwd=tmp_path,
    )  # fmt: skip
    try:
        wait_for(lambda: (tmp_path / "started").exists(), 120, "the task to start")
        job_id = slurm_cluster.run(["squeue", "-h", "-o", "%i", "-n", "killed-sub"]).stdout.strip()
        cancelled = time.monotonic()
        _run(["cancel", "--now", "--folder", str(folder), job_id], env)
        out, err = submit.communicate(timeout=60)  # the fault: this waited for ever
    finally:
        submit.kill()
    waited = time.monotonic() - cancelled
    assert submit.returncode != 0, (out, err)
    said = out + err  # SIGKILLed steps end the job CANCELLED or FAILED, as the race goes
    assert re.search(r"ended (CANCELLED|FAILED) without a result from task 0\b", said), said
    # Killed, it wrote no result: not waited for as long as a task that raised may lag in it.
    assert waited < RESULT_LAG_S, f"{waited:.0f} s for a result a killed task never writes"


@pytest.mark.parametrize(
    ("state", "exit_code", "lag"),
    [
        ("COMPLETED", "0:0", RESULT_LAG_S),
        ("FAILED", "1:0", RESULT_LAG_S),  # the task raised: submitit pickled the error first
        ("FAILED", "137:0", RESULT_LAG_UNSURE_S),  # srun's report of a SIGKILLed task
        ("FAILED", "0:9", RESULT_LAG_UNSURE_S),  # the batch shell itself killed
        ("CANCELLED", "0:15", RESULT_LAG_UNSURE_S),
    ],
)
def test_a_result_is_awaited_only_from_a_task_that_could_write_it(
    state: str, exit_code: str, lag: float
) -> None:
    """The SIGKILL race above ends the job FAILED as often as CANCELLED: a FAILED job's exit
    code says whether its task raised (and pickled a result) or was killed before it could."""
    assert result_lag(state, {"JobState": state, "ExitCode": exit_code}) == lag


# --- hostile folders and processes -----------------------------------------------------------
def _ended_pid() -> str:
    """The pid of a process that has ended: a local job's id whose controller is gone."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return str(proc.pid)


def _local_folder(folder: Path, job_id: str, pickled: bytes) -> Path:
    """What submitit's LocalExecutor leaves in its folder, every pickle holding ``pickled``."""
    folder.mkdir()
    for name in (f"{job_id}_submitted.pkl", f"{job_id}_0_result.pkl"):
        (folder / name).write_bytes(pickled)
    (folder / f"{job_id}_submission.sh").write_text("#!/bin/bash\n# submitit local job\n")
    (folder / f"{job_id}_0_log.out").write_text("the job's log\n")
    return folder


def _chown_all(folder: Path, uid: int) -> None:
    for path in [folder, *folder.iterdir()]:
        os.chown(path, uid, uid)


def _run_any(args: list[str], env: dict[str, str], timeout_s: float = 60) -> tuple[int, str, str]:
    proc = _hpc_ddp(args, env)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"hpc-ddp {args} did not end within {timeout_s} s") from None
    return proc.returncode, out, err


def test_status_and_logs_never_load_pickles_another_user_could_have_written(
    tmp_path: Path,
) -> None:
    """As root, a local job's folder owned by nobody: its pickles would run code. status and
    logs report the job (from /proc: it has ended) and its log, say why the pickles were not
    read, and the code never runs. A FIFO as a result pickle in a folder of ours: no hang."""
    canary = tmp_path / "code-ran"
    job_id = _ended_pid()
    theirs = _local_folder(tmp_path / "theirs", job_id, evil_pickle(canary))
    _chown_all(theirs, NOBODY_UID)

    code, out, err = _run_any(["status", job_id, "--folder", str(theirs)], {})
    assert not canary.exists(), "status loaded another user's pickle: its code ran"
    assert code == 0, (out, err)
    assert f"job {job_id} (local): ENDED" in out, out
    why = f"its folder {theirs} is owned by nobody (uid {NOBODY_UID}), not by you"
    for name in (f"{job_id}_submitted.pkl", f"{job_id}_0_result.pkl"):
        assert f"note: {theirs / name} not read: {why}" in out, out
    assert "a pickle runs code when it is loaded" in out, out

    code, out, err = _run_any(["logs", job_id, "--folder", str(theirs)], {})
    assert not canary.exists(), "logs loaded another user's pickle: its code ran"
    assert code == 0 and "the job's log" in out, (out, err)
    assert f"{theirs / f'{job_id}_submitted.pkl'} not read: {why}" in err, err

    ours = _local_folder(tmp_path / "ours", job_id, pickle.dumps("harmless"))
    make_fifo(ours / f"{job_id}_0_result.pkl")
    code, out, err = _run_any(["status", "--json", job_id, "--folder", str(ours)], {}, 30)
    report = json.loads(out)
    assert report["state"] == "ENDED", report
    assert report["notes"] == [
        f"{ours / f'{job_id}_0_result.pkl'} not read: it is a FIFO, not a regular file; a "
        "pickle runs code when it is loaded, so hpc-ddp loads only pickles nobody else could "
        "write"
    ], report


# Each case: how to spoil a private folder holding one pickle, and what the refusal says. The
# pickle would create the canary; "own file" is the control: a pickle of ours, loaded.
PICKLE_CASES = {
    "folder owned by nobody": "owned by nobody (uid 65534), not by you",
    "folder writable by all (0777)": "its folder {folder} is writable by other users (mode 0777)",
    "folder writable by its group (0770)": "writable by other users (mode 0770)",
    "folder is a link to a folder of ours": "its folder {folder} is a symbolic link",
    "pickle owned by nobody": "it is owned by nobody (uid 65534), not by you",
    "pickle writable by its group (0664)": "it is writable by other users (mode 0664)",
    "pickle is a FIFO": "it is a FIFO, not a regular file",
    "pickle is a link to a pickle of ours": "it is a symbolic link, not a regular file",
    "pickle is a device (/dev/zero's numbers)": "it is a character device, not a regular file",
    "pickle larger than 256 MiB (sparse)": "larger than the 268435456 bytes",
    "own file": None,
}


def _spoil(case: str, folder: Path, target: Path) -> Path:
    """Set up ``case`` around ``target`` (a private folder's pickle); returns the path to load."""
    if case == "folder owned by nobody":
        os.chown(folder, NOBODY_UID, NOBODY_UID)
    elif case.startswith(("folder writable", "pickle writable")):
        mode = int(re.search(r"\(0([0-7]+)\)", case).group(1), 8)  # type: ignore[union-attr]
        (folder if case.startswith("folder") else target).chmod(mode)
    elif case == "folder is a link to a folder of ours":
        link = folder.with_name(folder.name + "-link")
        link.symlink_to(folder)
        return link / target.name
    elif case == "pickle owned by nobody":
        os.chown(target, NOBODY_UID, NOBODY_UID)
    elif case == "pickle is a FIFO":
        make_fifo(target)
    elif case == "pickle is a link to a pickle of ours":
        real = folder / "real.pkl"
        target.rename(real)
        target.symlink_to(real)
    elif case.startswith("pickle is a device"):
        target.unlink()
        os.mknod(target, 0o600 | stat.S_IFCHR, os.makedev(1, 5))
    elif case.startswith("pickle larger"):
        os.truncate(target, (256 << 20) + 1)
    return target


def test_a_pickle_is_loaded_only_where_nobody_else_could_have_written_it(tmp_path: Path) -> None:
    """submitit's pickles through hpc_ddp's loader, each hostile case in a folder of its own,
    loaded in a child with a deadline (an open that blocks on the FIFO would hang it)."""
    canary = tmp_path / "code-ran"
    paths = {}
    for i, case in enumerate(PICKLE_CASES):
        folder = tmp_path / f"case{i}"
        folder.mkdir(mode=0o700)
        target = folder / "1234_0_result.pkl"
        target.write_bytes(pickle.dumps("ours") if case == "own file" else evil_pickle(canary))
        target.chmod(0o600)
        paths[case] = str(_spoil(case, folder, target))
    said = run_child(
        """
        import json, sys
        from pathlib import Path
        from hpc_ddp.deploy.submitit import pickles
        cap_memory()
        out = {}
        for case, path in json.loads(sys.argv[1]).items():
            try:
                out[case] = ["loaded", pickles.load(Path(path))]
            except pickles.PickleRefusedError as err:
                out[case] = ["refused", pickles.refusal_note(err)]
        print(json.dumps(out))
        """,
        json.dumps(paths),
        timeout=60,
    )
    assert not canary.exists(), "a refused pickle was loaded: its code ran"
    for case, expected in PICKLE_CASES.items():
        if expected is None:
            assert said[case] == ["loaded", "ours"], said[case]
            continue
        folder = str(Path(paths[case]).parent)
        what, note = said[case]
        assert what == "refused" and expected.format(folder=folder) in note, (case, note)
        assert note.startswith(f"{paths[case]} not read: "), note


@pytest.mark.slurm
def test_status_of_a_slurm_job_never_loads_pickles_from_another_users_folder(
    slurm_cluster, tmp_path: Path
) -> None:
    """The folder named by Slurm's record of a job (its StdOut's directory) belongs to nobody:
    the job is reported from Slurm's answer, the pickle there is not loaded, and status says
    why. The job is held, so it never runs."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, NOBODY_UID, NOBODY_UID)
    env = slurm_cluster.env
    job_id = slurm_cluster.run(
        ["sbatch", "--parsable", "--hold", f"--output={theirs}/%j_0_log.out",
         "--wrap", "true  # a submitit job's script, as hpc-ddp recognises one"],
    ).stdout.strip()  # fmt: skip
    try:
        canary = tmp_path / "code-ran"
        planted = theirs / f"{job_id}_submitted.pkl"
        planted.write_bytes(evil_pickle(canary))
        os.chown(planted, NOBODY_UID, NOBODY_UID)
        status, _ = _run(["status", job_id], env)
        assert not canary.exists(), "status loaded another user's pickle: its code ran"
        assert f"job {job_id} (submitit): PENDING" in status, status
        why = f"its folder {theirs} is owned by nobody (uid {NOBODY_UID}), not by you"
        assert f"note: {planted} not read: {why}" in status, status
    finally:
        slurm_cluster.run(["scancel", job_id], check=False)


def test_cancel_signals_only_a_local_job_the_toolkit_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real process with "submitit" in its command line, and a child, that hpc-ddp did not
    start: `cancel --now PID --folder F` with F holding its pickles refuses and both live on.
    A local job hpc-ddp did start is refused under another folder, then killed under its own;
    the cancel's marker replaces a link planted at its name, never writing through it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the records of local jobs
    stranger = subprocess.Popen(["bash", "-c", "sleep 300 & wait", "submitit"])
    try:
        wait_for(lambda: children(stranger.pid), 30, "the stranger's child")
        (child,) = children(stranger.pid)
        pid = str(stranger.pid)
        folder = _local_folder(tmp_path / "stranger", pid, pickle.dumps("harmless"))
        code, out, err = _run_any(["cancel", "--now", pid, "--folder", str(folder)], {})
        assert code == 2 and f"hpc-ddp has no record of starting process {pid}" in err, err
        assert stranger.poll() is None and os.path.exists(f"/proc/{child}"), "a stranger died"
    finally:
        stranger.kill()
        stranger.wait(timeout=30)

    sleeper = tmp_path / "sleeper.py"
    sleeper.write_text("import pathlib, time\npathlib.Path('started').touch()\ntime.sleep(300)\n")
    spec = JobSpec(name="ctl-kill", nodes=1, procs_per_node=1, time="10", module="",
                   script=str(sleeper))  # fmt: skip
    mine = tmp_path / "mine"
    monkeypatch.chdir(tmp_path)
    job = hpc_ddp.submit(spec, "local", folder=mine, wait=False)
    assert mine.stat().st_mode & 0o777 == 0o700  # submitit's folder: created private
    wait_for(lambda: (tmp_path / "started").exists(), 120, "the local job to start")
    other = tmp_path / "other"
    other.mkdir()
    name = f"{job.job_id}_submitted.pkl"
    (other / name).write_bytes((mine / name).read_bytes())
    code, out, err = _run_any(["cancel", "--now", job.job_id, "--folder", str(other)], {})
    assert code == 2 and f"with the folder {mine}, not {other}" in err, err
    assert job.status() == "RUNNING"

    target = tmp_path / "link-target"
    marker = mine / f"{job.job_id}_cancelled"
    marker.symlink_to(target)
    code, out, err = _run_any(["cancel", "--now", job.job_id, "--folder", str(mine)], {})
    assert code == 0 and f"job {job.job_id}: CANCELLED" in out, (out, err)
    assert job.wait(timeout_s=60).state == "CANCELLED"
    assert not os.path.lexists(target), "the cancel wrote through a planted link"
    assert marker.is_file() and not marker.is_symlink()
    status, _ = _run(["status", job.job_id, "--folder", str(mine)], {})
    assert f"job {job.job_id} (local): CANCELLED" in status, status


# --- hostile inputs: what job control reads that someone else may have put there -------------
# A log, a submission file or a job's Command file may sit in a shared directory: each is read
# only as a regular file, in bounded pieces; what a run dir's records say is shown escaped.
BIG_LOG = 512 << 20  # sparse: nothing is written to disk
LOG_MEMORY = 128 << 20  # what printing it may add to the reader's address space

PRINT_LOGS = """
import json, sys
from pathlib import Path
from hpc_ddp.deploy.job_control import follow_logs
from hpc_ddp.deploy.sbatch.backend import SlurmJob
from hpc_ddp.errors import HpcDdpError

class Tally:
    \"\"\"Keeps the output's size, its start and its end: nothing in between.\"\"\"
    size, head, tail = 0, "", ""
    def write(self, text):
        self.size += len(text)
        self.head = (self.head + text[:200])[:200]
        self.tail = (self.tail + text[-200:])[-200:]
    def flush(self):
        pass

cap_memory(int(sys.argv[2]))
tally, error = Tally(), None
try:
    follow_logs(SlurmJob("12", {}, Path(sys.argv[1])), tally)
except HpcDdpError as err:
    error = str(err)
print(json.dumps({"size": tally.size, "head": tally.head, "tail": tally.tail, "error": error}))
"""


def test_logs_print_a_huge_log_in_bounded_memory_and_refuse_what_is_no_file(
    tmp_path: Path,
) -> None:
    """A 512 MiB batch log (sparse) printed in a process that may use 128 MiB more than it has
    after its imports: read whole, it ended in MemoryError. Every byte arrives, the last line
    without a line break too. Rank logs that are a FIFO (a read would block) and a link to
    /dev/zero (a read would never end) are named in the error that follows the printing."""
    out = tmp_path / "job.out"
    with out.open("wb") as f:
        f.write(b"first line\n")
        f.seek(BIG_LOG)
        f.write(b"last line, no line break")
    make_fifo(tmp_path / "job.out.rank0")
    symlink_to(tmp_path / "job.out.rank1", "/dev/zero")
    said = run_child(PRINT_LOGS, str(out), str(LOG_MEMORY), timeout=120)
    header = f"==> {out} <==\n"
    assert said["size"] == len(header) + out.stat().st_size, said["size"]
    assert said["head"].startswith(header + "first line\n\0"), said["head"]
    assert said["tail"].endswith("\0last line, no line break"), said["tail"]
    assert f"{out}.rank0: a FIFO, not a regular file" in said["error"], said
    assert f"{out}.rank1: a character device, not a regular file" in said["error"], said


def test_job_id_0_which_slurm_reads_as_every_job_is_refused(tmp_path: Path) -> None:
    """`scontrol show job 0` lists every job: `status 0` showed another user's. Refused in each
    command before Slurm is asked, and a run dir's records naming job 0 name no job."""
    env = {"HPC_DDP_LOCAL_SLURM_DIR": f"/tmp/hpcddp-none-{os.getpid()}"}  # no cluster there
    for args in (["status", "0"], ["logs", "00"], ["logs", "-f", "0"], ["cancel", "0_1"]):
        _, err = _run(args, env, timeout_s=60, rc=2)
        assert "is job 0, which Slurm reads as every job" in err and "HINT:" in err, err
    with pytest.raises(ConfigError, match="is job 0"):
        hpc_ddp.attach_job("0")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    owner = {"pid": 1, "host": "h", "since": "2024-01-01T00:00:00Z", "job_id": "0"}
    (run_dir / ".run.lock.owner").write_text(json.dumps(owner))
    progress = {"status": "training", "slurm_job": {"id": "000", "restarts": 2}}
    (run_dir / "progress.json").write_text(json.dumps(progress))
    status, _ = _run(["status", str(run_dir)], env, timeout_s=60)
    assert "job ? (run dir): UNKNOWN, restarts 0" in status, status


def test_status_of_a_run_dir_shows_its_records_text_escaped(tmp_path: Path) -> None:
    """progress.json and result.json are anyone's text in a shared run dir: a terminal escape
    (clear the screen, set the window title) or a line break in a key or a value reaches the
    terminal escaped, never as a control character."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    progress = {"status": "\x1b[2J\x1b]0;pwned\x07", "\x1b[31mstep": 3, "note": "a\nb\rc\x9b"}
    (run_dir / "progress.json").write_text(json.dumps(progress))
    (run_dir / "result.json").write_text(json.dumps({"status": "fin\x1b[8mished"}))
    status, _ = _run(["status", str(run_dir)], {}, timeout_s=60)
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]", status), repr(status)
    assert "status \\x1b[2J\\x1b]0;pwned\\x07" in status, status
    assert "\\x1b[31mstep 3, note a\\nb\\rc\\x9b" in status, status
    assert "status: fin\\x1b[8mished" in status, status


@pytest.mark.slurm
def test_status_reads_no_fifo_or_device_as_a_jobs_command_file(
    slurm_cluster, tmp_path: Path
) -> None:
    """A job without a batch script Slurm gives out (an srun job here; another user's batch job
    alike) is read from its Command, the path scontrol reports, which its owner can replace
    once the job runs: by a FIFO, whose read blocked `status` for ever, or a link to /dev/zero,
    whose read never ended. `status` reads neither and answers at once."""
    env = slurm_cluster.env
    program = tmp_path / "program.sh"
    program.write_text("#!/bin/sh\ntouch started\nexec sleep 300\n")
    program.chmod(0o755)
    srun = subprocess.Popen(
        ["srun", "-N1", "-J", "ctl-command", "-t", "5", str(program)], env=env, cwd=tmp_path,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    job_id = ""
    try:

        def running() -> str:
            ask = ["squeue", "-h", "-n", "ctl-command", "-t", "RUNNING", "-o", "%i"]
            return slurm_cluster.run(ask).stdout.strip()

        job_id = wait_for(running, 60, "the srun job to run")
        wait_for(lambda: (tmp_path / "started").exists(), 60, "the program to start")
        assert slurm_cluster.job_info(job_id)["Command"] == str(program)
        for hostile in (make_fifo, lambda p: symlink_to(p, "/dev/zero")):
            hostile(program)
            status, _ = _run(["status", job_id], env, timeout_s=60)
            assert f"job {job_id} (sbatch): RUNNING" in status, status
    finally:
        if job_id:
            slurm_cluster.cancel(job_id)
        srun.kill()
        srun.wait(timeout=30)
