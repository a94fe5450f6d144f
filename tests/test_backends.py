"""Every backend behind one interface, from Python (``hpc_ddp.describe`` / ``hpc_ddp.submit``).

Real parts: sbatch, scontrol and scancel on the project's local Slurm cluster; submitit's
LocalExecutor running the trainer; pdsh's and clush's ``exec`` workers running a Gloo job on two
"hosts" of this machine (no second physical host can exist here, see launch_support). The
structure the interface rests on (deploy never imports the embedded cluster, no import cycle) is
tests/test_import_graph.py's.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_support import progress_status, train_args
from launch_support import SETUP, WORKER, assert_no_processes_left, hpc_ddp, kill_leftovers

import hpc_ddp as api
from hpc_ddp.deploy.shell.tool_argv import launch_command
from hpc_ddp.errors import ConfigError, HpcDdpError
from hpc_ddp.localslurm import wait_for


# --- describe: the script itself, nothing runs --------------------------------------------------
def test_describe_is_render(tmp_path: Path) -> None:
    spec = api.JobSpec(nodes=2, gpus_per_node=8, args=["--epochs", "1", "--run-dir=runs/x"])
    plan = api.describe(spec, cwd=tmp_path, produced_by="hpc-ddp render")
    assert plan.text == str(plan) == api.render(spec)
    assert plan.executor == "sbatch"
    assert plan.run_paths == api.RunPaths(tmp_path / "runs/x")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("args", "workdir", "expected"),
    [
        (["--run-dir", "a"], "", "a"),
        (["--run-dir=b"], "", "b"),
        (["--run-d", "c"], "", "c"),  # the trainer's parser takes unambiguous prefixes
        (["--config", "train.toml"], "", "from-config"),
        (["--config", "train.toml", "--run-dir", "flag"], "", "flag"),  # flags win
        ([], "", "runs/train"),  # the trainer's default
        (["--run-dir", "d"], "sub", "sub/d"),  # relative to the job's working directory
    ],
)
def test_the_run_dir_comes_from_the_trainers_own_parser(
    tmp_path: Path, args: list[str], workdir: str, expected: str
) -> None:
    for where in (tmp_path, tmp_path / "sub"):
        where.mkdir(exist_ok=True)
        (where / "train.toml").write_text('run_dir = "from-config"\n')
    spec = api.JobSpec(workdir=workdir, args=args)
    assert api.describe(spec, cwd=tmp_path).run_paths == api.RunPaths(tmp_path / expected)
    # A committed render carries no spec: its trainer line is read with the same parser.
    script = tmp_path / "job.sbatch"
    script.write_text(api.render(spec))
    assert api.describe(script, cwd=tmp_path).run_paths == api.RunPaths(tmp_path / expected)


def test_a_job_without_the_trainer_has_the_run_dir_it_is_given(tmp_path: Path) -> None:
    spec = api.JobSpec(module="hpc_ddp.deploy.preflight", args=["--run-dir", "x"])
    assert api.describe(spec, cwd=tmp_path).run_paths == api.RunPaths(tmp_path / "x")
    assert api.describe(spec.replace(args=[]), cwd=tmp_path).run_paths is None


def test_trainer_arguments_the_trainer_would_refuse_fail_early(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="the trainer would refuse its arguments"):
        api.JobSpec(args=["--epochs", "two"])
    with pytest.raises(ConfigError, match=r"train\.toml does not exist"):
        api.describe(api.JobSpec(args=["--config", "train.toml"]), cwd=tmp_path)


def test_submitit_describe_shows_the_task_and_creates_nothing(tmp_path: Path) -> None:
    spec = api.JobSpec(nodes=1, procs_per_node=2, time="5", args=["--run-dir", "r"])
    plan = api.describe(spec, "local", folder=tmp_path / "logs", cwd=tmp_path)
    assert "LocalExecutor" in plan.text and "tasks_per_node=2" in plan.text
    assert f"{sys.executable} -u -m hpc_ddp.train --run-dir r --requeue none" in plan.text
    assert plan.run_paths == api.RunPaths(tmp_path / "r")
    assert not any(tmp_path.iterdir())
    # Any other program runs as given: no trainer flags, no result.json to report.
    (tmp_path / "mine.py").write_text("")
    script = spec.replace(module="", script="mine.py", args=["--x", "a b"])
    plan = api.describe(script, "submitit", folder=tmp_path / "logs", cwd=tmp_path)
    assert f"\n{sys.executable} -u mine.py --x 'a b'\n" in plan.text
    assert plan.run_paths is None and not (tmp_path / "logs").exists()
    module = api.describe(spec.replace(module="pkg.train", args=["-v"]), "local", cwd=tmp_path)
    assert f"\n{sys.executable} -u -m pkg.train -v\n" in module.text and module.run_paths is None


def test_an_sbatch_script_job_reports_the_run_dir_it_gives_its_program(tmp_path: Path) -> None:
    """A spec's own program told ``--run-dir X`` or ``--run-dir=X``: submit shows that run
    dir's result.json, or says truly that there is none; it said the job had no --run-dir."""
    from hpc_ddp.commands.submit import _report
    from hpc_ddp.deploy.backend import Finished
    from hpc_ddp.deploy.sbatch.backend import SlurmJob

    (tmp_path / "mine.py").write_text("")
    spec = api.JobSpec(nodes=1, procs_per_node=1, time="5", module="", script="mine.py")
    for args, run_dir in (
        (["--seed", "1", "--run-dir", "out"], "out"),
        (["--run-dir=first", "--run-dir=out/b"], "out/b"),  # the last one counts
        (["--", "--run-dir", "x"], None),  # after `--`: an operand, not the option
        (["--seed", "1"], None),
    ):
        plan = api.describe(spec.replace(args=args), cwd=tmp_path)
        expected = api.RunPaths(tmp_path / run_dir) if run_dir else None
        assert plan.run_paths == expected, args

    done = Finished("7", "COMPLETED", 0)
    plan = api.describe(spec.replace(args=["--run-dir", "out"]), cwd=tmp_path)
    job = SlurmJob("7", {}, None, plan.run_paths)
    said = _report("sbatch", spec, job, done, followed=False)
    assert f"{tmp_path / 'out' / 'result.json'} does not exist: the job wrote none" in said
    result = {"status": "fine\x1b[2J", "steps": 3}
    said = _report(
        "sbatch", spec, job, Finished("7", "COMPLETED", 0, result=result), followed=False
    )
    assert f"result ({tmp_path / 'out' / 'result.json'}):" in said, said
    assert "status: fine\\x1b[2J" in said and "steps: 3" in said, said  # shown escaped
    none = _report("sbatch", spec, SlurmJob("7", {}, None, None), done, followed=False)
    assert "the spec gives its program (mine.py) no --run-dir: no result.json to show" in none


def test_a_submitit_folder_with_a_line_break_is_refused_before_anything(tmp_path: Path) -> None:
    """submitit writes its folder into #SBATCH lines: a line break there would start a line of
    the batch shell. The CLI, describe/submit and Executor all refuse it, creating nothing."""
    folder = str(tmp_path / "logs\ntouch PWNED #")
    spec_file = tmp_path / "job.toml"
    spec_file.write_text('name = "j"\nnodes = 1\nprocs_per_node = 1\ntime = "5"\n')
    cli = hpc_ddp(
        ["submit", str(spec_file), "--executor", "submitit", "--dry-run", "--folder", folder]
    )
    assert cli.returncode == 2, cli
    assert "submitit folder" in cli.stderr and "U+000A LINE FEED" in cli.stderr, cli.stderr
    spec = api.JobSpec(nodes=1, procs_per_node=1, time="5")
    for executor in ("submitit", "local"):
        with pytest.raises(ConfigError, match="U\\+000A LINE FEED"):
            api.describe(spec, executor, folder=folder, cwd=tmp_path)
    with pytest.raises(ConfigError, match="submitit folder"):
        api.Executor(folder, "local")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.toml"]


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        ("nobody", "owned by nobody (uid 65534), not by you"),
        ("0777", "writable by other users (mode 0777)"),
        ("link", "a symbolic link"),
    ],
)
def test_a_submitit_folder_another_user_could_change_is_refused_before_anything(
    tmp_path: Path, spoil: str, said: str
) -> None:
    """submitit keeps the job's pickles in its folder and loading one runs its code: an existing
    folder gets every private dir's checks (real chown to nobody; the suite runs as root). The
    CLI, describe/submit and Executor refuse it, nothing is written inside."""
    folder = tmp_path / "logs"
    folder.mkdir(mode=0o700)
    if spoil == "nobody":
        os.chown(folder, 65534, 65534)
    elif spoil == "0777":
        folder.chmod(0o777)
    else:
        folder.rename(tmp_path / "real")
        folder.symlink_to(tmp_path / "real")
    spec_file = tmp_path / "job.toml"
    spec_file.write_text('name = "j"\nnodes = 1\nprocs_per_node = 1\ntime = "5"\n')
    cli = hpc_ddp(["submit", str(spec_file), "--executor", "local", "--folder", str(folder)])
    assert cli.returncode == 2, cli
    assert f"submitit folder {folder} is {said}" in cli.stderr and "HINT:" in cli.stderr, cli
    spec = api.JobSpec(nodes=1, procs_per_node=1, time="5")
    for executor in ("submitit", "local"):
        with pytest.raises(ConfigError, match=re.escape(said)):
            api.submit(spec, executor, folder=folder, cwd=tmp_path, wait=False)
    with pytest.raises(ConfigError, match=re.escape(said)):
        api.Executor(folder, "local")
    assert not any(folder.iterdir())


def test_a_launch_describes_its_script_and_the_dry_run_command(tmp_path: Path) -> None:
    spec = api.make_launch_spec(
        tool="clush", hosts="n[1-2]", command=["--run-dir", "r"], launch_id="L7", rcmd="exec",
        workdir=str(tmp_path), python="python3",
    )  # fmt: skip
    plan = api.describe(spec)
    assert plan.executor == "clush" and plan.text.startswith("#!/usr/bin/env bash")
    assert plan.command == launch_command(spec).shell()
    assert plan.run_paths == api.RunPaths(tmp_path / "r")
    # `hpc-ddp launch --dry-run` prints that very command.
    res = hpc_ddp(["launch", "clush", "--hosts", "n[1-2]", "--launch-id", "L7", "--rcmd", "exec",
                   "--workdir", str(tmp_path), "--python", "python3", "--no-forward-env",
                   "--dry-run", "--", "--run-dir", "r"])  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert res.stdout == plan.command + "\n"


@pytest.mark.parametrize(
    ("job", "executor", "needle"),
    [
        ("spec", "mpirun", "executor 'mpirun' is not one of"),
        ("spec", "pdsh", "needs a LaunchSpec"),
        ("launch", "sbatch", "runs with its tool, pdsh"),
        ("script", "local", r"needs a job spec \(\.toml/\.json\)"),
        ("missing", "sbatch", "does not exist"),
    ],
)
def test_wrong_pairs_of_job_and_executor_are_config_errors(
    tmp_path: Path, job: str, executor: str, needle: str
) -> None:
    (tmp_path / "job.sbatch").write_text("#!/bin/bash\n")
    jobs = {
        "spec": api.JobSpec(),
        "launch": api.make_launch_spec(tool="pdsh", hosts="n1", command=["true"]),
        "script": tmp_path / "job.sbatch",
        "missing": tmp_path / "nope.toml",
    }
    with pytest.raises(ConfigError, match=needle) as err:
        api.describe(jobs[job], executor)
    assert err.value.hint


class _Ended(api.Job):
    """A job that has ended: what ``hpc-ddp submit`` reports on needs no scheduler."""

    def __init__(self, run_paths: api.RunPaths) -> None:
        self.executor, self.job_id, self.run_paths = "sbatch", "7", run_paths

    def status(self) -> str:
        return "COMPLETED"

    def wait(self, timeout_s: float | None = None) -> api.Finished:
        raise AssertionError("not asked")

    def cancel(self) -> None:
        raise AssertionError("not asked")


@pytest.mark.parametrize("executor", ["sbatch", "submitit"])
def test_submit_reports_the_result_once_and_names_the_plot(executor: str, tmp_path: Path) -> None:
    """Following the log shows the trainer's own result lines: the report then names the file
    instead of printing them again. Unfollowed (--quiet), it prints them. plot.png is named
    where the trainer drew one."""
    from hpc_ddp.commands.submit import _report

    paths = api.RunPaths(tmp_path / "run")
    paths.root.mkdir()
    result = {"status": "finished", "test_accuracy": 0.5, "params_sha256": "ab" * 32}
    paths.result.write_text(json.dumps(result))
    done = api.Finished("7", "COMPLETED", 0, 0, None, result)
    restarts = ", restarts 0" if executor == "sbatch" else ""
    head = f"job 7: COMPLETED, exit code 0{restarts}"
    followed = _report(executor, api.JobSpec(), _Ended(paths), done, followed=True)
    assert (
        followed == f"{head}\nresult: {paths.result} (its lines are above, at the end of the log)"
    )
    quiet = _report(executor, api.JobSpec(), _Ended(paths), done, followed=False).splitlines()
    assert (
        quiet[:2] == [head, f"result ({paths.result}):"]
        and f"  params_sha256: {'ab' * 32}" in quiet
    )

    paths.plot.write_bytes(b"\x89PNG")
    for follow in (True, False):
        report = _report(executor, api.JobSpec(), _Ended(paths), done, followed=follow).splitlines()
        assert report[-1] == f"plot: {paths.plot} (loss and accuracy per epoch)"
        assert sum("params_sha256" in line for line in report) == (not follow)


# --- sbatch on the real local Slurm cluster -----------------------------------------------------
@pytest.mark.slurm
def test_submit_sbatch_follows_the_trainer_to_its_result(slurm_cluster, tmp_path: Path) -> None:
    """The run dir comes from the trainer's --config file, which a search of the script's text
    could never find; the job's log is followed into ``follow`` while it runs."""
    (tmp_path / "train.toml").write_text('run_dir = "from-config"\n')
    (tmp_path / "data").mkdir()
    args = train_args(str(tmp_path / "data"), "unused")[:-2]  # without --run-dir
    spec = api.JobSpec(
        name="api-sbatch", nodes=1, procs_per_node=2, time="5", python=sys.executable,
        output=str(tmp_path / "%x-%j.out"), args=[*args, "--epochs", "1", "--config", "train.toml"],
    )  # fmt: skip
    log = io.StringIO()
    job = api.submit(spec, cluster_env=slurm_cluster.env, cwd=tmp_path, follow=log, wait=False)
    assert job.executor == "sbatch" and job.job_id.isdigit()
    assert job.status() in ("PENDING", "RUNNING", "COMPLETING", "COMPLETED")
    assert job.run_paths == api.RunPaths(tmp_path / "from-config")
    done = job.wait(timeout_s=180)
    assert (done.state, done.exit_code, done.restarts) == ("COMPLETED", 0, 0), log.getvalue()
    assert done.result == json.loads((tmp_path / "from-config" / "result.json").read_text())
    assert done.result["status"] == "finished" and done.result["world_size"] == 2
    assert done.output == tmp_path / f"api-sbatch-{job.job_id}.out"
    assert "hpc-ddp preflight: rank=1/2" in log.getvalue()  # followed, as it was written
    assert job.wait() is done and job.status() == "COMPLETED"


@pytest.mark.slurm
def test_cancel_and_a_missed_deadline_end_a_slurm_job(slurm_cluster, tmp_path: Path) -> None:
    sleeper = tmp_path / "sleep.py"
    sleeper.write_text("import time\ntime.sleep(600)\n")
    spec = api.JobSpec(
        name="api-sleep", time="5", python=sys.executable, module="", script=str(sleeper),
        preflight=False, output=str(tmp_path / "%x-%j.out"),
    )  # fmt: skip
    options = dict(cluster_env=slurm_cluster.env, cwd=tmp_path, wait=False)
    cancelled, late = api.submit(spec, **options), api.submit(spec, **options)
    assert cancelled.run_paths is None
    wait_for(lambda: cancelled.status() == "RUNNING", 60, "the job to start")
    cancelled.cancel()
    assert cancelled.wait(timeout_s=60).state == "CANCELLED"
    with pytest.raises(HpcDdpError, match=f"job {late.job_id} still .* cancelled it"):
        late.wait(timeout_s=2)
    wait_for(lambda: late.status() == "CANCELLED", 60, "the late job to be cancelled")


# --- submitit's LocalExecutor ---------------------------------------------------------------
def _trainer_pids(run_dir: Path) -> list[int]:
    """Trainer processes of this run: ``--run-dir`` followed by ``run_dir`` in their argv."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"hpc_ddp.train" in argv and str(run_dir).encode() in argv:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("submitter_ignores_sigint", [False, True])
def test_cancelling_a_local_submitit_job_ends_its_trainer(
    tmp_path: Path, submitter_ignores_sigint: bool
) -> None:
    """submitit cancels a local job with SIGINT to its task; the trainer the task started must
    end with it (it checkpoints on SIGTERM) instead of training on as an orphan. Also when the
    submitter ignores SIGINT (a script's ``cmd &`` starts it so): the job must not inherit that,
    or the cancel waits for nothing."""
    (tmp_path / "data").mkdir()
    run = tmp_path / "run"
    args = train_args(str(tmp_path / "data"), str(run), "--debug-hold-at-step", "2")
    spec = api.JobSpec(name="api-local", nodes=1, procs_per_node=1, time="5", args=args)
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if submitter_ignores_sigint else None
    try:
        job = api.submit(spec, "local", folder=tmp_path / "submitit", wait=False)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    try:
        wait_for(lambda: progress_status(run) == "holding", 120, "the trainer to hold")
        assert job.status() == "RUNNING" and _trainer_pids(run)
        job.cancel()
        done = job.wait(timeout_s=60)
        assert done.state == "CANCELLED" and done.exit_code != 0, done
        wait_for(lambda: not _trainer_pids(run), 30, "the trainer to end")
    finally:
        for pid in _trainer_pids(run):
            subprocess.run(["kill", "-9", str(pid)], check=False)


# --- pdsh / clush through the Python API ------------------------------------------------------
def _launch(tool: str, tmp: Path, *worker_args: str) -> api.LaunchSpec:
    return api.make_launch_spec(
        tool=tool, hosts="node[0-1]", rcmd="exec", mode="processes", gpus_per_node=2,
        command=["python3", WORKER, "--out", str(tmp / "out"), *worker_args],
        setup=[SETUP], workdir=str(tmp), state_dir=str(tmp / "state"), stop_grace_s=3,
    )  # fmt: skip


@pytest.mark.parametrize("tool", ["pdsh", "clush"])
def test_submit_a_launch_runs_every_host_to_the_end(tool: str, tmp_path: Path) -> None:
    out = io.StringIO()
    spec = _launch(tool, tmp_path)
    try:
        job = api.submit(spec, follow=out, timeout_s=120)
    finally:
        kill_leftovers(spec.launch_id)
    done = job.wait()
    assert (job.executor, job.job_id) == (tool, spec.launch_id)
    assert (done.state, done.exit_code, done.error) == ("COMPLETED", 0, ""), out.getvalue()
    seen = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank-*.json"))]
    assert [s["rank"] for s in seen] == [0, 1, 2, 3] and {s["world_size"] for s in seen} == {4}
    assert "all 2 host(s) finished with exit code 0" in out.getvalue()


def test_a_failed_host_fails_the_launch_and_cancel_stops_it(tmp_path: Path) -> None:
    failing = _launch("pdsh", tmp_path / "a", "--fail-rank", "3")
    hanging = _launch("clush", tmp_path / "b", "--hang-rank", "0")
    for spec in (failing, hanging):
        (tmp_path / spec.workdir).mkdir(parents=True, exist_ok=True)
    try:
        done = api.submit(failing, timeout_s=120).wait()
        assert (done.state, done.exit_code) == ("FAILED", 1) and "node1" in done.error, done
        job = api.submit(hanging, wait=False)
        wait_for(lambda: (tmp_path / "b" / "out" / "hanging-0").exists(), 60, "rank 0 to hang")
        assert job.status() == "RUNNING"
        job.cancel()
        stopped = job.wait()
        assert (stopped.state, stopped.exit_code) == ("CANCELLED", 143), stopped
        assert_no_processes_left(hanging.launch_id)
    finally:
        kill_leftovers(failing.launch_id)
        kill_leftovers(hanging.launch_id)
