"""Rendered jobs on the real local Slurm cluster (2 nodes, real sbatch/srun/scancel/scontrol).

What is real: slurmctld + 2 slurmd, sbatch, srun's task placement and kill-on-bad-exit, signal
delivery, requeue with SLURM_RESTART_COUNT, torchrun's c10d rendezvous, Gloo DDP training.
What is not: the GPUs. ``slurm_gpu_cluster`` declares fake GPUs (gres over character devices),
so Slurm's GPU binding (CUDA_VISIBLE_DEVICES per task) is real but nothing computes on them; the
GPU-layout jobs therefore run the torch-free preflight as their program instead of the trainer.
Both "nodes" share this machine's network stack (no second physical host, no InfiniBand).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from deploy_support import (
    progress_status,
    read_result,
    reference_run_fixture,  # noqa: F401  (the reference_run fixture)
    submit_spec,
    train_args,
    train_spec,
)
from slurm_support import late_reply_scontrol_path

from hpc_ddp.deploy import JobSpec
from hpc_ddp.deploy.sbatch.render import render
from hpc_ddp.deploy.sbatch.submit import wait_job
from hpc_ddp.localslurm import wait_for

pytestmark = pytest.mark.slurm

PREFLIGHT = re.compile(
    r"hpc-ddp preflight: rank=(\d+)/(\d+) local_rank=(\d+)/(\d+) node_rank=(\d+)/(\d+) "
    r"node=(\S+) master=(\S+):(\d+) .*"
    r"(?:device=CPU|gpus=(\S+) gpus_per_process=(\d+) CUDA_VISIBLE_DEVICES=(\S+))"
)


def _ranks(log: str) -> dict[int, tuple[str, ...]]:
    return {int(m.group(1)): m.groups() for m in PREFLIGHT.finditer(log)}


def test_cpu_srun_job_trains_with_the_right_ranks(reference_run) -> None:
    """The reference job itself: 2 nodes x 2 processes, real srun placement and env."""
    cwd, done = reference_run
    log = done.output.read_text() if done.output else ""
    assert (done.state, done.exit_code) == ("COMPLETED", 0), log
    ranks = _ranks(log)
    assert sorted(ranks) == [0, 1, 2, 3], log
    assert log.count(" device=CPU") == 4 and "gpus=-" not in log, log  # a CPU job says so
    for rank, g in ranks.items():
        assert g[1] == "4" and g[3] == "2" and g[5] == "2"  # world 4, 2 per node, 2 nodes
        assert int(g[2]) == rank % 2 and int(g[4]) == rank // 2  # local rank, node rank
        assert g[6] == f"node{rank // 2 + 1}"  # block placement, Slurm's order
        assert g[7] == "node1"  # master = first host of the node list, for every rank
    assert len({g[8] for g in ranks.values()}) == 1  # one port everyone derived alone
    result = read_result(cwd / "run")
    assert result["status"] == "finished" and result["world_size"] == 4


# A job program that asks for its own requeue as the trainer does under --requeue scontrol
# (a hand-written batch script), handling SIGTERM as the trainer's default stop signals do.
_REQUEUE_ITSELF = """
import os, signal
from hpc_ddp.runtime.preemption import requeue
signal.signal(signal.SIGTERM, lambda *_: print("got SIGTERM", flush=True))
restart = os.environ.get("SLURM_RESTART_COUNT", "0")
print(f"run {restart}:", requeue("scontrol") if restart == "0" else "done", flush=True)
"""


@pytest.mark.slow
def test_the_trainers_own_requeue_reports_success_when_scontrol_answers_late(
    slurm_cluster, tmp_path: Path
) -> None:
    """``requeue("scontrol")`` inside a real job, its scontrol answering 3 s late
    (late_reply_scontrol_path): Slurm SIGTERMs every process of the requeued job before the
    reply, and the requeue, which succeeded, must not be reported as failed."""
    path = late_reply_scontrol_path(tmp_path / "bin", slurm_cluster.env)
    script = tmp_path / "requeue_itself.sh"
    script.write_text(
        f"#!/bin/bash\nexport PATH={shlex.quote(path)}\n"
        f"exec {shlex.quote(sys.executable)} -c {shlex.quote(_REQUEUE_ITSELF)}\n"
    )
    done = slurm_cluster.sbatch_wait(
        script, "--requeue", "--open-mode=append", timeout_s=90, output=tmp_path / "out"
    )
    said = done.output
    assert (done.state, done.exit_code) == ("COMPLETED", 0), said
    assert f"run 0: requeued Slurm job {done.job_id} (scontrol requeue)" in said, said
    assert "got SIGTERM" in said, said  # the requeue's SIGTERM did come, before the reply
    assert "run 1: done" in said, said


def test_dead_rank_ends_the_job_instead_of_hanging(slurm_cluster, tmp_path: Path) -> None:
    """Rank 1 dies at once, the others would wait 5 minutes: srun --kill-on-bad-exit ends it."""
    script = tmp_path / "die.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['SLURM_PROCID'] == '1':\n    sys.exit(3)\n"
        "time.sleep(300)\n"
    )
    spec = JobSpec(
        name="dead-rank", nodes=2, procs_per_node=2, module="", script=str(script),
        python=sys.executable, output="%x-%j.out", time="10",
    )  # fmt: skip
    start = time.monotonic()
    job_id, out = submit_spec(spec, tmp_path, slurm_cluster.env)
    done = wait_job(job_id, slurm_cluster.env, timeout_s=60, output=out)
    assert done.state == "FAILED" and done.exit_code != 0, out.read_text()
    assert time.monotonic() - start < 30
    assert "task 1: Exited with exit code 3" in out.read_text()


def test_a_range_of_nodes_runs_on_what_slurm_gives_and_every_rank_sees_it(
    slurm_cluster, tmp_path: Path
) -> None:
    """nodes = "1-3" on this 2-node cluster: Slurm gives the job fewer nodes than its MAX, the
    batch shell reads how many, and every rank's world, node rank and placement follow that
    number (the preflight as the program)."""
    spec = JobSpec(
        name="range", nodes="1-3", procs_per_node=2, module="hpc_ddp.deploy.preflight",
        python=sys.executable, output="%x-%j.out", time="5", preflight=False,
        setup=['echo "hpc-ddp test: Slurm gave ${SLURM_JOB_NUM_NODES} node(s)"'],
    )  # fmt: skip
    job_id, out = submit_spec(spec, tmp_path, slurm_cluster.env)
    done = wait_job(job_id, slurm_cluster.env, timeout_s=60, output=out)
    log = out.read_text()
    assert (done.state, done.exit_code) == ("COMPLETED", 0), log
    given = re.search(r"Slurm gave (\d+) node", log)
    assert given is not None and 1 <= int(given.group(1)) <= 2, log
    nodes = int(given.group(1))
    ranks = _ranks(log)
    assert sorted(ranks) == list(range(2 * nodes)), log
    for rank, g in ranks.items():
        assert (g[1], g[3], g[5]) == (str(2 * nodes), "2", str(nodes)), g  # world, local, nodes
        assert int(g[4]) == rank // 2 and g[6] == f"node{rank // 2 + 1}", g


@pytest.mark.parametrize(
    ("kw", "per_rank"),
    [
        (dict(gpu_binding="gpus-per-node"), {0: ("0", "0,1"), 1: ("1", "0,1")}),
        (dict(gpu_binding="gpus-per-task"), {0: ("0", "0"), 1: ("0", "1")}),
        (dict(gpus_per_process=2), {0: ("0,1", "0,1")}),
        (dict(launcher="torchrun"), {0: ("0", "0,1"), 1: ("1", "0,1")}),
    ],
    ids=["per-gpu-gpus-per-node", "per-gpu-gpus-per-task", "per-node", "torchrun"],
)
def test_gpu_layouts_bind_gpus_as_intended(
    slurm_gpu_cluster, tmp_path: Path, kw: dict, per_rank: dict
) -> None:
    """Fake GPUs (gres): Slurm's binding is real, so each process's CUDA_VISIBLE_DEVICES and
    the GPUs hpc_ddp.cluster assigns from it are checked; the program is the preflight."""
    spec = JobSpec(
        name="gpu", nodes=2, gpus_per_node=2, module="hpc_ddp.deploy.preflight",
        python=sys.executable, output="%x-%j.out", time="5", preflight=False, **kw,
    )  # fmt: skip
    job_id, out = submit_spec(spec, tmp_path, slurm_gpu_cluster.env)
    done = wait_job(job_id, slurm_gpu_cluster.env, timeout_s=60, output=out)
    log = out.read_text()
    assert (done.state, done.exit_code) == ("COMPLETED", 0), log
    ranks = _ranks(log)
    assert sorted(ranks) == list(range(spec.world_size)), log
    for rank, g in ranks.items():
        local = rank % spec.ppn
        assert (g[9], g[11]) == per_rank[local], (rank, g)
        assert g[10] == str(spec.gpus_per_process)


def test_nested_submission_does_not_inherit_the_parent_layout(
    slurm_cluster, tmp_path: Path
) -> None:
    """A 2x2 job's task (which also looks like a torchrun worker: RANK, MASTER_PORT) submits a
    1x1 job through hpc_ddp.deploy.sbatch.submit.sbatch: the child must see none of that, only its
    own layout, and still reach the same cluster (SLURM_CONF kept)."""
    child = JobSpec(
        name="child", nodes=1, module="hpc_ddp.deploy.preflight", python=sys.executable,
        output="%x-%j.out", time="5", preflight=False,
        setup=['echo "child batch: STEP_TASKS=${SLURM_STEP_NUM_TASKS:-unset} '
               'NTASKS=${SLURM_NTASKS} MASTER_PORT=${MASTER_PORT:-unset} RANK=${RANK:-unset}"'],
    )  # fmt: skip
    (tmp_path / "child.sbatch").write_text(render(child))
    parent_py = tmp_path / "parent.py"
    parent_py.write_text(
        "import os, pathlib\n"
        "from hpc_ddp.deploy.sbatch.submit import sbatch\n"
        "os.environ.update(MASTER_PORT='12345', RANK='3', WORLD_SIZE='4')\n"
        "if os.environ['SLURM_PROCID'] == '0':\n"
        "    cwd = pathlib.Path.cwd()\n"
        "    sub = sbatch(cwd / 'child.sbatch', {}, cwd=cwd)\n"
        "    (cwd / 'child.id').write_text(sub.job_id)\n"
    )
    parent = JobSpec(
        name="parent", nodes=2, procs_per_node=2, module="", script=str(parent_py),
        python=sys.executable, output="%x-%j.out", time="5", preflight=False,
    )  # fmt: skip
    job_id, out = submit_spec(parent, tmp_path, slurm_cluster.env)
    done = wait_job(job_id, slurm_cluster.env, timeout_s=60, output=out)
    assert done.state == "COMPLETED", out.read_text()
    child_id = (tmp_path / "child.id").read_text()
    child_out = tmp_path / f"child-{child_id}.out"
    cdone = wait_job(child_id, slurm_cluster.env, timeout_s=60, output=child_out)
    log = child_out.read_text()
    assert cdone.state == "COMPLETED", log
    ranks = _ranks(log)
    assert "child batch: STEP_TASKS=unset NTASKS=1 MASTER_PORT=unset RANK=unset" in log, log
    assert list(ranks) == [0] and ranks[0][1] == "1", log  # one task, world 1: its own layout
    assert ranks[0][8] != "12345"


# --- hpc-ddp submit ---------------------------------------------------------------------------
def _tiny_spec_file(tmp_path: Path, **kw: object) -> Path:
    data = dict(
        name="cli", nodes=2, procs_per_node=1, time="5", output="run/%x-%j.out",
        python=sys.executable, setup=["mkdir -p data"], args=train_args("data", "run", plot=True),
    )  # fmt: skip
    data.update(kw)
    path = tmp_path / "job.json"
    path.write_text(json.dumps(data))
    return path


def _hpc_ddp(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hpc_ddp.cli", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip


@pytest.mark.slow
def test_submit_without_slurm_uses_the_embedded_cluster(tmp_path: Path) -> None:
    """No SLURM_CONF, no /etc/slurm: `hpc-ddp submit` starts the embedded cluster, renders the
    spec, follows the log (the trainer's result lines in it, once), names result.json and
    plot.png, says that the cluster keeps running and how to stop it, and exits with the job's
    code."""
    from slurm_support import clean_job_env, require_local_slurm

    from hpc_ddp.localslurm import LocalCluster

    require_local_slurm()
    if Path("/etc/slurm/slurm.conf").exists():
        pytest.skip("a system Slurm is configured here; the embedded default is not used")
    root = Path(tempfile.mkdtemp(prefix="hpcddp-sub-", dir="/tmp"))
    env = clean_job_env(HPC_DDP_LOCAL_SLURM_DIR=str(root))
    try:
        proc = _hpc_ddp(
            ["submit", str(_tiny_spec_file(tmp_path)), "--wait-timeout", "120"], tmp_path, env
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"Slurm: the embedded local cluster in {root} (" in proc.stdout  # says where
        assert "hpc-ddp preflight: rank=1/2" in proc.stdout  # the log was followed
        assert "COMPLETED, exit code 0" in proc.stdout
        sha = read_result(tmp_path / "run")["params_sha256"]
        assert proc.stdout.count(f"params_sha256: {sha}") == 1, proc.stdout  # the trainer's
        run_dir = tmp_path / "run"
        assert f"result: {run_dir / 'result.json'} (its lines are above" in proc.stdout
        assert f"plot: {run_dir / 'plot.png'} (loss and accuracy per epoch)\n" in proc.stdout
        running = f"the embedded local cluster in {root} keeps running"
        assert proc.stdout.endswith("`hpc-ddp cluster down` stops it\n") and running in proc.stdout

        failing = tmp_path / "fail.py"
        failing.write_text("import sys\nsys.exit(3)\n")
        # One task: with several, srun's code can be 143 (a peer killed by kill-on-bad-exit).
        spec = _tiny_spec_file(tmp_path, nodes=1, module="", script=str(failing), args=[])
        proc = _hpc_ddp(["submit", str(spec), "--wait-timeout", "60", "--quiet"], tmp_path, env)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "FAILED, exit code 3" in proc.stdout and running in proc.stdout
    finally:
        LocalCluster(root).stop()
        shutil.rmtree(root, ignore_errors=True)


def test_submit_rejects_a_bad_spec_before_sbatch(slurm_cluster, tmp_path: Path) -> None:
    spec = _tiny_spec_file(tmp_path, gpus_per_node=8, gpus_per_process=3)
    before = slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout
    proc = _hpc_ddp(["submit", str(spec)], tmp_path, slurm_cluster.env)
    assert proc.returncode == 2 and "valid gpus_per_process" in proc.stderr
    assert "submitted" not in proc.stdout
    assert slurm_cluster.run(["squeue", "-h", "-o", "%i"]).stdout == before


def test_broken_launch_env_fails_in_preflight_not_in_training(
    slurm_gpu_cluster, tmp_path: Path
) -> None:
    """Two processes per node that each want both of the node's 2 (fake) GPUs: the preflight
    step refuses in seconds with a HINT and the training step never starts."""
    spec = JobSpec(
        name="bad-gpus", nodes=2, gpus_per_node=2, python=sys.executable, output="%x-%j.out",
        time="5", setup=["export HPC_DDP_GPUS_PER_PROCESS=2  # the mistake"],
        module="hpc_ddp.deploy.port",  # would print a port if it ever ran
    )  # fmt: skip
    start = time.monotonic()
    job_id, out = submit_spec(spec, tmp_path, slurm_gpu_cluster.env)
    done = wait_job(job_id, slurm_gpu_cluster.env, timeout_s=60, output=out)
    log = out.read_text()
    assert (done.state, done.exit_code) == ("FAILED", 2), log
    assert "preflight FAILED" in log and "GPUs per node" in log and "HINT" in log, log
    assert "preflight failed, not starting training" in log
    assert "step ended" not in log
    assert time.monotonic() - start < 30


@pytest.mark.slow
def test_array_tasks_train_into_their_own_run_dirs_and_requeue_alone(
    slurm_cluster, tmp_path: Path
) -> None:
    """A 2-task array (``array = "0-1"``) of the tiny run, 1 node x 2 processes per task: each
    task trains into run_<task id> and logs to %x-%A_<task id>.out. USR1 to task 1 only: its
    trainer requeues ``<array>_1`` (hpc_ddp.runtime.preemption's array-aware id) while task 0 is
    still holding with no restart; then task 0 gets its own signal. Both end resumed, each once."""
    (tmp_path / "logs").mkdir()
    spec = train_spec(
        "arr", nodes=1, output="logs/%x-%j.out", array="0-1",
        args=train_args("data", "run", "--debug-hold-at-step", "3"),
    )  # fmt: skip
    array_id, _ = submit_spec(spec, tmp_path, slurm_cluster.env)
    tasks = [f"{array_id}_{i}" for i in (0, 1)]
    for i in (0, 1):
        wait_for(lambda i=i: progress_status(tmp_path / f"run_{i}") == "holding", 120, f"task {i}")
    slurm_cluster.run(["scancel", "--signal=USR1", tasks[1]])
    wait_for(lambda: slurm_cluster.job_info(tasks[1]).get("Restarts") == "1", 120, "1 requeued")
    task0 = slurm_cluster.job_info(tasks[0])
    assert (task0["JobState"], task0["Restarts"]) == ("RUNNING", "0"), task0
    slurm_cluster.run(["scancel", "--signal=USR1", tasks[0]])
    for i, task in enumerate(tasks):
        log = tmp_path / "logs" / f"arr-{array_id}_{i}.out"
        done = wait_job(task, slurm_cluster.env, timeout_s=180, output=log)
        assert (done.state, done.exit_code, done.restarts) == ("COMPLETED", 0, 1), log.read_text()
        result = read_result(tmp_path / f"run_{i}")
        assert (result["status"], result["interruptions"], result["world_size"]) == (
            "finished", 1, 2,
        )  # fmt: skip
        assert "resumed from" in log.read_text()
    assert not (tmp_path / "run").exists()  # no task used the spec's run dir itself
