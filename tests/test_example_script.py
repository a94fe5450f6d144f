"""examples/ddp_train.py, a user's own DDP script on the public API, under real launchers.

Real torchrun with 2 Gloo ranks; the real local Slurm cluster (2 nodes x 2 tasks, real sbatch,
scancel --signal=USR1, scontrol requeue); real pdsh and clush through their ``exec`` workers. Not
real: a second physical host (pdsh's/clush's "hosts" and the two slurmd share this machine) and
GPUs (the script runs on CPU with Gloo here). Every interrupted run must end with the weights of
the uninterrupted one, bit for bit, and must have learnt its data.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from launch_support import (
    REPO,
    assert_no_processes_left,
    hpc_ddp,
    kill_leftovers,
    launch_args,
)
from slurm_support import require_tools
from trainer_helpers import finish, forked_script, run, start, torchrun_cmd

from hpc_ddp.polling import wait_for
from hpc_ddp.slurm_client import TERMINAL

EXAMPLE = str(REPO / "examples" / "ddp_train.py")
# 1030 samples: at world 2, 515 per rank = 8 full steps of 2 x 32 and a short one (9 a epoch);
# 257 test samples split 129 + 128 (exact evaluation counts each once).
ARGS = ["--samples", "1030", "--epochs", "2", "--checkpoint-every", "4"]
HOLDING = re.compile(r"rank (\d+) pid (\d+) holding at step (\d+)")
CHANCE = 0.25  # 4 classes


def _result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def _holding(log: Path, ranks: int, proc: subprocess.Popen[str] | None = None) -> dict[int, int]:
    """rank -> pid, once every rank printed that it holds (else empty); fails if ``proc`` ended."""
    text = log.read_text(errors="replace") if log.exists() else ""
    found = {int(m[1]): int(m[2]) for m in HOLDING.finditer(text)}
    if proc is not None and proc.poll() is not None:
        raise AssertionError(f"exited ({proc.returncode}) before holding:\n{text}")
    return found if len(found) == ranks else {}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run on 2 forked ranks: what every other run must match."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    done = run(forked_script(2, EXAMPLE, [*ARGS, "--run-dir", str(run_dir)]))
    assert done.returncode == 0, done.stdout + done.stderr
    result = _result(run_dir)
    assert f"params_sha256={result['params_sha256']}" in done.stdout
    return result


def test_uninterrupted_run_learns_with_exact_evaluation(reference: dict) -> None:
    assert (reference["world_size"], reference["epochs"], reference["steps"]) == (2, 2, 18)
    assert reference["test_samples"] == 257 and reference["test_samples_per_rank"] == [129, 128]
    assert reference["test_accuracy"] > CHANCE + 0.5, reference  # learnt, not guessed


def test_fast_changes_nothing_on_a_cpu_and_says_so(reference: dict, tmp_path: Path) -> None:
    """--fast: hpc_ddp.speed_up before DDP (docs/your-code.md, "A faster step"); on the CPU it
    leaves the model and optimizer as built, so the run ends with the reference's weights."""
    run_dir = tmp_path / "run"
    done = run(forked_script(2, EXAMPLE, [*ARGS, "--fast", "--run-dir", str(run_dir)]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("step: as given (the model is on cpu, not a CUDA device)") == 1
    assert _result(run_dir)["params_sha256"] == reference["params_sha256"]


@pytest.mark.slow
def test_torchrun_interrupted_by_a_signal_resumes_bit_identical(
    reference: dict, tmp_path: Path
) -> None:
    """SIGUSR1 to rank 1 alone at step 5: both ranks agree, checkpoint, exit 75; the rerun
    resumes there and ends with the reference's weights."""
    run_dir, log = tmp_path / "run", tmp_path / "interrupted.log"
    cmd = torchrun_cmd(2, [*ARGS, "--run-dir", str(run_dir), "--hold-at-step", "5"], EXAMPLE)
    proc = start(cmd, log)
    try:
        pids = wait_for(lambda: _holding(log, 2, proc), 90, "both ranks to hold")
        subprocess.run(["kill", "-USR1", str(pids[1])], check=True)
    finally:
        rc, text = finish(proc, log)
    assert rc != 0, text  # torchrun reports its workers' exit 75 as a failure
    assert "preempted at step 5: checkpointed; exit 75" in text, text
    assert text.count("exitcode  : 75") == 2, text
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-00000005"
    assert not (run_dir / "result.json").exists()

    done = run(forked_script(2, EXAMPLE, [*ARGS, "--run-dir", str(run_dir)]))  # resumes anywhere
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from" in done.stdout and "step-00000005: epoch 1, step 5" in done.stdout
    result = _result(run_dir)
    assert result["params_sha256"] == reference["params_sha256"]
    assert result["test_accuracy"] == reference["test_accuracy"]


@pytest.mark.parametrize(
    ("tool", "hosts", "per_host", "mode"),
    [("pdsh", "node[0-1]", 1, "torchrun"), ("clush", "localhost", 2, "processes")],
    ids=["pdsh-2-hosts", "clush-one-machine-2-processes"],
)
def test_launch_without_scheduler_ends_with_the_same_weights(
    reference: dict, tmp_path: Path, tool: str, hosts: str, per_host: int, mode: str
) -> None:
    """``hpc-ddp launch`` runs the script as given: on two "hosts", and on one machine's 2
    process slots (how a script of your own uses one machine's GPUs with hpc-ddp; `hpc-ddp train
    --nproc-per-node` runs only the project's trainer)."""
    require_tools(tool)
    launch = launch_args(tool, tmp_path, mode=mode, hosts=hosts, gpus_per_node=per_host)
    try:
        res = hpc_ddp(
            [*launch.base, "--", sys.executable, EXAMPLE, *ARGS, "--run-dir", "run"], timeout=180
        )
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        result = _result(tmp_path / "run")
        assert result["world_size"] == 2
        assert result["params_sha256"] == reference["params_sha256"]
        assert_no_processes_left(launch.launch_id)
    finally:
        kill_leftovers(launch.launch_id)


def test_render_takes_a_script_without_clearing_the_module(tmp_path: Path) -> None:
    """``--script`` alone replaces the default program (the trainer module); both is an error."""
    res = hpc_ddp(["render", "--nodes", "2", "--script", EXAMPLE, "--dry-run", "--", "--epochs"])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.replace("\\\n", " ")  # the script's continuation lines joined
    assert re.search(rf"\nsrun [^\n]* python -u +{re.escape(EXAMPLE)} --epochs &\n", lines)
    assert "hpc_ddp.train" not in lines
    both = hpc_ddp(["render", "--script", EXAMPLE, "--module", "pkg.mod", "--dry-run"])
    assert both.returncode == 2 and "of module (python -m) and script" in both.stderr


def _render(cwd: Path, name: str, *args: str) -> Path:
    """The job as a user renders it: the real CLI, 2 nodes x 2 tasks, the script's own flags."""
    job = cwd / f"{name}.sbatch"
    res = hpc_ddp(
        ["render", "--name", name, "--nodes", "2", "--procs-per-node", "2", "--time", "5",
         "--signal-lead-s", "60", "--python", sys.executable, "--script", EXAMPLE,
         "--script-out", str(job), "--", *ARGS, "--run-dir", "run", *args]
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return job


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_job_preempted_requeued_resumes_with_the_same_weights(
    slurm_cluster, tmp_path: Path
) -> None:
    """A rendered job whose every task holds at step 3 until ``scancel --signal=USR1`` (no
    flag: the step tasks) arrives. Its rank 0 then runs ``scontrol requeue``; Slurm restarts the
    job, which resumes from the checkpoint and ends with the weights of the uninterrupted run
    (on 4 forked ranks, beside it: the launcher changes no weight). World 4: with more than two
    ranks the gradient sums' order matters (per_tensor_allreduce). The srun layout's one test
    for a script of the user's: hpc_ddp.Resumable takes the same path (Preemption,
    requeue("auto"), exit 75), so test_resumable.py runs only the torchrun layout."""
    ref_dir, ref_log = tmp_path / "ref" / "run", tmp_path / "ref.log"
    ref = start(forked_script(4, EXAMPLE, [*ARGS, "--run-dir", str(ref_dir)]), ref_log)
    cwd = tmp_path / "pre"
    cwd.mkdir()
    pre_id, pre_log = slurm_cluster.sbatch(
        _render(cwd, "example-pre", "--hold-at-step", "3"), output=cwd / "job.out", cwd=cwd
    )
    wait_for(lambda: _holding(pre_log, 4), 120, "4 tasks to hold")
    slurm_cluster.run(["scancel", "--signal=USR1", pre_id])

    seen: list[str] = []

    def ended() -> bool:
        seen.append(slurm_cluster.job_state(pre_id))
        return seen[-1] in TERMINAL

    wait_for(ended, 180, "the job to end", interval_s=0.2)
    rc, ref_text = finish(ref, ref_log, timeout=180)
    assert rc == 0, ref_text
    info, text = slurm_cluster.job_info(pre_id), pre_log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), text
    results = {"ref": _result(ref_dir), "pre": _result(cwd / "run")}
    for result in results.values():
        assert result["world_size"] == 4 and result["test_accuracy"] > CHANCE + 0.5
    assert "PENDING" in seen and info["Restarts"] == "1", seen
    # Rendered srun jobs requeue from the batch shell (HPC_DDP_REQUEUE_BY=batch): the script's
    # Preemption.requeue() leaves it to that shell, so the job is asked for once.
    assert f"step exited 75 (checkpointed): requeueing job {pre_id}" in text, text
    assert "preempted at step 3" in text and "step-00000003: epoch 1, step 3" in text, text
    assert results["pre"]["params_sha256"] == results["ref"]["params_sha256"]


# --- submitit: `hpc-ddp submit --executor submitit|local` runs the script in every task --------
SUBMITTED = re.compile(r"submitted (?:submitit|local) job (\d+); logs in ")


def _spec_file(tmp: Path, procs: tuple[int, int], *args: str, script: str = EXAMPLE) -> Path:
    """A job file a user would write for the script: ``procs`` = (nodes, tasks per node)."""
    spec = tmp / "job.toml"
    toml_args = ", ".join(json.dumps(a) for a in args)
    spec.write_text(
        f'name = "example-sub"\nnodes = {procs[0]}\nprocs_per_node = {procs[1]}\n'
        f'time = "30"\nscript = {json.dumps(script)}\nargs = [{toml_args}]\n'
    )
    return spec


def _submit_cmd(executor: str, spec: Path, folder: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hpc_ddp.cli", "submit", "--executor", executor,
            "--folder", str(folder), "--wait-timeout", "240", *extra, str(spec)]  # fmt: skip


@pytest.mark.slow
def test_local_executor_runs_the_script_to_the_same_weights(
    reference: dict, tmp_path: Path
) -> None:
    """submitit's LocalExecutor, 1 node x 2 tasks: each task runs ``python -u ddp_train.py`` with
    its rank, world and master set; the job ends COMPLETED with the torchrun run's weights. A
    script that fails, and one that does not exist, are reported by name."""
    run_dir, folder = tmp_path / "run", tmp_path / "submitit"
    spec = _spec_file(tmp_path, (1, 2), *ARGS, "--run-dir", str(run_dir))
    dry = run(_submit_cmd("local", spec, folder, "--dry-run"))
    assert dry.returncode == 0 and not folder.exists(), dry.stderr
    assert f"-u {EXAMPLE} {' '.join(ARGS)} --run-dir {run_dir}\n" in dry.stdout, dry.stdout

    done = run(_submit_cmd("local", spec, folder), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"job \d+: COMPLETED, exit code 0\n", done.stdout), done.stdout
    assert _result(run_dir)["params_sha256"] == reference["params_sha256"]
    assert f"params_sha256={reference['params_sha256']}" in done.stdout  # rank 0's log followed

    failing = tmp_path / "fails.py"
    failing.write_text("import sys\nsys.exit(3)\n")
    bad = run(_submit_cmd("local", _spec_file(tmp_path, (1, 1), script=str(failing)), folder))
    assert bad.returncode == 1 and "FAILED, exit code 1" in bad.stdout, bad.stdout + bad.stderr
    assert f"{failing} (rank 0) exited with code 3" in bad.stdout, bad.stdout

    missing = _spec_file(tmp_path, (1, 1), script="no/such_script.py")
    refused = run(_submit_cmd("local", missing, tmp_path / "never"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "script 'no/such_script.py': no such file in" in refused.stderr, refused.stderr
    assert "HINT:" in refused.stderr and not (tmp_path / "never").exists()


def _holding_in(folder: Path, ranks: int) -> dict[int, int]:
    """rank -> pid once every task's log in submitit's folder says it holds."""
    text = "".join(log.read_text(errors="replace") for log in folder.glob("*_log.out"))
    found = {int(m[1]): int(m[2]) for m in HOLDING.finditer(text)}
    return found if len(found) == ranks else {}


@pytest.mark.slurm
@pytest.mark.slow
def test_submitit_job_preempted_with_usr1_requeues_to_the_same_weights(
    slurm_cluster, reference: dict, tmp_path: Path
) -> None:
    """``hpc-ddp submit --executor submitit``: 2 nodes x 1 task (world 2, the reference's) on the
    local cluster, every task holding at step 3 until ``scancel --signal=USR1`` (no flag: the
    step's processes, submitit's task and the script alike). The script checkpoints and exits
    75; rank 0's task takes submitit's requeue path (checkpoint(), scontrol requeue); the rerun
    resumes from step 3 and the job ends COMPLETED with the uninterrupted run's weights. A
    script on hpc_ddp.Resumable takes this path too (the same Preemption and requeue("auto")):
    this is the one submitit preemption test for a script of the user's."""
    run_dir, folder, log = tmp_path / "run", tmp_path / "submitit", tmp_path / "submit.log"
    spec = _spec_file(tmp_path, (2, 1), *ARGS, "--run-dir", str(run_dir), "--hold-at-step", "3")
    with log.open("w") as out:
        proc = subprocess.Popen(
            _submit_cmd("submitit", spec, folder), stdout=out, stderr=subprocess.STDOUT,
            env=slurm_cluster.env, cwd=tmp_path, text=True,
        )  # fmt: skip
    try:
        wait_for(lambda: _holding_in(folder, 2) or proc.poll() is not None, 120, "2 tasks to hold")
        assert proc.poll() is None, log.read_text()
        job_id = SUBMITTED.search(log.read_text())[1]
        slurm_cluster.run(["scancel", "--signal=USR1", job_id])
        rc = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert rc == 0 and f"job {job_id}: COMPLETED, exit code 0" in text, text
    info = slurm_cluster.job_info(job_id)
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), info
    rank0 = next(folder.glob(f"{job_id}_0_log.out")).read_text()
    assert "preempted at step 3: checkpointed; exit 75" in rank0, rank0
    assert "running under submitit, which requeues" in rank0, rank0  # the script asked no one
    assert "Calling checkpoint method" in rank0 and "step-00000003: epoch 1, step 3" in rank0
    # submitit's requeue path, told the signal: a preemption (30 min asked), not a time-out.
    err = next(folder.glob(f"{job_id}_0_log.err")).read_text()
    assert "Caught signal SIGUSR1" in err and "this job is preempted" in err, err
    result = _result(run_dir)
    assert (result["world_size"], result["steps"]) == (2, 18)
    assert result["params_sha256"] == reference["params_sha256"]
