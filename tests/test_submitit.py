"""The trainer through submitit: LocalExecutor on this machine, AutoExecutor on the real local
Slurm cluster (sbatch, srun, scancel, scontrol requeue, all real), with a real preemption.

Nothing is mocked. On Slurm, submitit's preemption signal (USR2) is sent with
``scancel --signal=USR2`` to the job's tasks, as Slurm's ``--signal=USR2@N`` would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_ddp.deploy import JobSpec
from hpc_ddp.deploy.submitit_backend import submit_train, wait_submitit
from hpc_ddp.localslurm import wait_for


def _args(tmp: Path, *extra: str) -> list[str]:
    (tmp / "data").mkdir(exist_ok=True)
    return [
        "--dataset", "cifar10", "--synthetic", "--synthetic-train-size", "512",
        "--synthetic-test-size", "128", "--data-dir", str(tmp / "data"), "--model", "lenet",
        "--epochs", "2", "--batch-size", "32", "--checkpoint-every-steps", "2",
        "--run-dir", str(tmp / "run"), *extra,
    ]  # fmt: skip


def _status(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("status")
    except (OSError, ValueError):
        return None


def test_local_executor_trains_two_tasks(tmp_path: Path) -> None:
    spec = JobSpec(name="sl", nodes=1, procs_per_node=2, time="5", args=_args(tmp_path))
    job = submit_train(spec, kind="local", folder=tmp_path / "submitit")
    state, code, result = wait_submitit(job, timeout_s=120)
    assert (state, code) == ("COMPLETED", 0), (result, job.stderr())
    assert result["status"] == "finished" and result["world_size"] == 2


def test_local_executor_needs_one_node(tmp_path: Path) -> None:
    from hpc_ddp.errors import ConfigError

    with pytest.raises(ConfigError, match="one machine"):
        submit_train(JobSpec(nodes=2), kind="local", folder=tmp_path)


@pytest.mark.slurm
def test_auto_executor_preempted_requeues_and_resumes_exactly(slurm_cluster, tmp_path) -> None:
    env = slurm_cluster.env
    ref_dir, pre_dir = tmp_path / "ref", tmp_path / "pre"
    ref_dir.mkdir()
    pre_dir.mkdir()

    ref_spec = JobSpec(name="ss-ref", nodes=2, time="5", args=_args(ref_dir))
    ref = submit_train(ref_spec, kind="submitit", folder=ref_dir / "submitit", cluster_env=env)
    state, code, ref_result = wait_submitit(ref, timeout_s=120, cluster_env=env)
    assert (state, code) == ("COMPLETED", 0), (ref_result, ref.stderr())
    assert ref_result["world_size"] == 2

    spec = JobSpec(
        name="ss-pre", nodes=2, time="30", args=_args(pre_dir, "--debug-hold-at-step", "3")
    )
    job = submit_train(spec, kind="submitit", folder=pre_dir / "submitit", cluster_env=env)
    wait_for(lambda: _status(pre_dir / "run" / "progress.json") == "holding", 90, "holding")
    slurm_cluster.run(["scancel", "--signal=USR2", str(job.job_id)])
    state, code, result = wait_submitit(job, timeout_s=150, cluster_env=env)
    info = slurm_cluster.job_info(str(job.job_id))
    assert (state, code) == ("COMPLETED", 0), (result, job.stderr())
    assert info.get("Restarts") == "1", info
    assert result["interruptions"] == 1
    assert result["params_sha256"] == ref_result["params_sha256"]
    # submitit's own path ran: preempted (not timed out: 30 min asked), checkpoint(), requeue.
    err, out = Path(job.paths.stderr).read_text(), Path(job.paths.stdout).read_text()
    assert "this job is preempted" in err, err
    assert "Calling checkpoint method" in out, out
