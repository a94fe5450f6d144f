"""Submission environment scrubbing (pure; the real nested submission is in test_slurm_jobs.py)."""

from __future__ import annotations

import os

from hpc_ddp.deploy.submission_env import scrubbed_environ, submission_env

PARENT = {
    "SLURM_CONF": "/etc/x/slurm.conf",
    "SLURM_JOB_ID": "7",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_NUM_TASKS": "16",
    "SLURMD_NODENAME": "n1",
    "SBATCH_PARTITION": "gpu",
    "SRUN_CPUS_PER_TASK": "8",
    "SUBMITIT_EXECUTOR": "slurm",
    "TORCHELASTIC_RUN_ID": "7",
    "RANK": "3",
    "MASTER_PORT": "29500",
    "CUDA_VISIBLE_DEVICES": "3",
    "HPC_DDP_NODE_RANK": "1",
    "HPC_DDP_LAUNCH_TAG": "abc/node0",
    "HPC_DDP_LOCAL_SLURM_DIR": "/tmp/s",
    "PATH": "/usr/bin",
    "NCCL_DEBUG": "INFO",
}


def test_submission_env_drops_the_enclosing_job_and_keeps_the_cluster() -> None:
    env = submission_env(PARENT)
    assert env == {
        "SLURM_CONF": "/etc/x/slurm.conf",
        "HPC_DDP_LOCAL_SLURM_DIR": "/tmp/s",
        "PATH": "/usr/bin",
        "NCCL_DEBUG": "INFO",
    }


def test_scrubbed_environ_restores_everything() -> None:
    before = dict(os.environ)
    os.environ["SLURM_NTASKS"] = "4"
    try:
        with scrubbed_environ({"SLURM_CONF": "/tmp/c"}):
            assert "SLURM_NTASKS" not in os.environ
            assert os.environ["SLURM_CONF"] == "/tmp/c"
        assert os.environ["SLURM_NTASKS"] == "4"
    finally:
        os.environ.clear()
        os.environ.update(before)
