"""The trainer through submitit: LocalExecutor on this machine, AutoExecutor on the real local
Slurm cluster (sbatch, srun, scancel, scontrol requeue, all real), with a real preemption.

Nothing is mocked. On Slurm, submitit's preemption signal (USR2) is sent with
``scancel --signal=USR2`` to the job's tasks, as Slurm's ``--signal=USR2@N`` would.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_support import (
    progress_status,
    read_result,
    reference_run_fixture,  # noqa: F401  (the reference_run fixture)
    train_args,
)

import hpc_ddp
from hpc_ddp.deploy import JobSpec
from hpc_ddp.errors import ConfigError
from hpc_ddp.localslurm import wait_for


def _args(tmp: Path, *extra: str) -> list[str]:
    # Absolute paths: a submitit job runs in the submitter's working directory.
    (tmp / "data").mkdir(exist_ok=True)
    return train_args(str(tmp / "data"), str(tmp / "run"), *extra)


def test_local_executor_trains_two_tasks(tmp_path: Path) -> None:
    spec = JobSpec(name="sl", nodes=1, procs_per_node=2, time="5", args=_args(tmp_path))
    job = hpc_ddp.submit(spec, "local", folder=tmp_path / "submitit", wait=False)
    done = job.wait(timeout_s=180)
    assert (done.state, done.exit_code) == ("COMPLETED", 0), (done.error, job.job.stderr())
    assert done.result["status"] == "finished" and done.result["world_size"] == 2
    assert job.run_paths == hpc_ddp.RunPaths(tmp_path / "run")
    assert job.read_result() == done.result  # rank 0 returned what the trainer wrote


def test_a_failing_task_other_than_the_first_fails_the_job(tmp_path: Path) -> None:
    """Every task's outcome counts, not only task 0's: rank 1 exits 3, the job fails with it."""
    script = tmp_path / "rank1fails.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    spec = JobSpec(
        name="r1fails", nodes=1, procs_per_node=2, time="5", module="", script=str(script)
    )
    job = hpc_ddp.submit(spec, "local", folder=tmp_path / "submitit", wait=False)
    done = job.wait(timeout_s=120)
    assert done.exit_code == 1, done
    assert "task 1 failed" in done.error and "exited with code 3" in done.error, done.error


def test_local_executor_needs_one_node(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one machine"):
        hpc_ddp.submit(JobSpec(nodes=2), "local", folder=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.mark.slurm
@pytest.mark.slow
def test_auto_executor_preempted_requeues_and_resumes_exactly(
    slurm_cluster, reference_run, tmp_path: Path
) -> None:
    """The same trainer as the sbatch reference (2 nodes x 2 tasks, world 4), through AutoExecutor.
    USR2 to the tasks -> submitit calls ProgramTask.checkpoint() on rank 0, which waits for the
    trainer child's checkpoint; submitit requeues; the rerun resumes and matches the reference."""
    env = slurm_cluster.env
    args = _args(tmp_path, "--debug-hold-at-step", "3")
    spec = JobSpec(name="ss-pre", nodes=2, procs_per_node=2, time="30", args=args)
    job = hpc_ddp.submit(
        spec, "submitit", folder=tmp_path / "submitit", cluster_env=env, wait=False
    )
    wait_for(lambda: progress_status(tmp_path / "run") == "holding", 120, "trainer holding")
    slurm_cluster.run(["scancel", "--signal=USR2", job.job_id])
    done = job.wait(timeout_s=180)
    assert (done.state, done.exit_code) == ("COMPLETED", 0), (done.error, job.job.stderr())
    assert done.restarts == 1, slurm_cluster.job_info(job.job_id)
    result = done.result
    assert (result["interruptions"], result["world_size"]) == (1, 4)  # the reference's world
    assert result["params_sha256"] == read_result(reference_run[0] / "run")["params_sha256"]
    # submitit's own path ran: preempted (not timed out: 30 min asked), checkpoint(), requeue.
    err, out = Path(job.job.paths.stderr).read_text(), Path(job.job.paths.stdout).read_text()
    assert "this job is preempted" in err, err
    assert "Calling checkpoint method" in out, out
