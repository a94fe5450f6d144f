"""hpc_ddp.Resumable: a plain DDP script made preemption-safe with exact resume in a few lines.

examples/plain_ddp.py knows nothing of hpc-ddp; examples/resumable_ddp.py is the same script with
the lines docs/your-code.md shows. Interrupted by a real signal at whatever step the timing
gives (each optimizer step slowed by tests/workers/slow_steps.py, so that the signal lands mid-run)
and started again, it must end with the uninterrupted run's weights, bit for bit: under torchrun
here, and on the local Slurm's torchrun layout (2 nodes x 2 tasks: real sbatch, srun, torchrun,
scancel --signal, scontrol requeue). Not real: a second physical host, GPUs (CPU and Gloo here).
"""

from __future__ import annotations

import difflib
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch_support import REPO, hpc_ddp
from trainer_helpers import TORCHRUN, finish, run, start

from hpc_ddp.slurm_client import TERMINAL, wait_for
from hpc_ddp.train.fingerprint import params_sha256

PLAIN = REPO / "examples" / "plain_ddp.py"
RESUMABLE = REPO / "examples" / "resumable_ddp.py"
SLOW = str(REPO / "tests" / "workers" / "slow_steps.py")
EPOCHS = ["--epochs", "3"]
STEPS_PER_EPOCH = {2: 32, 4: 16}  # 2048 samples, batch 32, per world size
PREEMPTED = re.compile(r"preempted at step (\d+): checkpointed")


def _sha(run_dir: Path) -> str:
    return params_sha256(torch.load(run_dir / "model.pt", weights_only=True))


def _code_lines(path: Path) -> list[str]:
    """The script's lines after its docstring, without comments: what a user edits."""
    text = path.read_text()
    body = text.split('"""', 2)[2]
    return [re.sub(r"\s+#.*$", "", line) for line in body.splitlines()]


def test_the_resumable_script_differs_from_the_plain_one_by_at_most_10_lines() -> None:
    diff = difflib.ndiff(_code_lines(PLAIN), _code_lines(RESUMABLE))
    added = [line for line in diff if line.startswith("+ ") and line[2:].strip()]
    assert len(added) <= 10, added
    assert "import hpc_ddp" not in PLAIN.read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The uninterrupted runs' weights at world 2 and 4 (torchrun on this machine)."""
    shas = {}
    for world in (2, 4):
        run_dir = tmp_path_factory.mktemp(f"ref{world}") / "run"
        cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={world}", str(RESUMABLE), *EPOCHS]
        done = run([*cmd, "--run-dir", str(run_dir)], timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        shas[world] = _sha(run_dir)
    return shas


def test_torchrun_interrupted_mid_epoch_resumes_bit_identical(
    reference: dict[int, str], tmp_path: Path
) -> None:
    run_dir, log = tmp_path / "run", tmp_path / "first.log"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", SLOW, "0.05", str(RESUMABLE), *EPOCHS]
    proc = start([*cmd, "--run-dir", str(run_dir)], log)
    wait_for(lambda: "epoch 1:" in log.read_text() or proc.poll() is not None, 120, "epoch 1")
    proc.send_signal(signal.SIGTERM)  # torchrun hands it to its workers
    rc, text = finish(proc, log)
    step = int(PREEMPTED.search(text)[1])
    assert rc != 0 and step % STEPS_PER_EPOCH[2] != 0, text  # torchrun reports 75 as 1
    assert not (run_dir / "model.pt").exists()

    again = run([*cmd, "--run-dir", str(run_dir)], timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {run_dir / 'checkpoints'}/step-{step:08d}: epoch 2, step {step}" in (
        again.stdout
    ), again.stdout
    assert _sha(run_dir) == reference[2]


def test_what_cannot_resume_is_refused_by_name() -> None:
    code = (
        "import torch, hpc_ddp\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "data = TensorDataset(torch.zeros(8, 2))\n"
        "for bad in (dict(loader=DataLoader(data, 2, shuffle=True)), dict(model=object())):\n"
        "    try:\n"
        "        hpc_ddp.Resumable('/nonexistent/never', **bad)\n"
        "    except hpc_ddp.HpcDdpError as err:\n"
        "        print(str(err).replace('\\n', ' '))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 2, done.stdout + done.stderr
    assert "RandomSampler" in lines[0] and "DistributedSampler" in lines[0]
    assert "object has no state_dict" in lines[1]
    assert not Path("/nonexistent/never").exists()


# --- the local Slurm: the torchrun layout ------------------------------------------------------
# One job, the torchrun layout, where rank 0 of a script's job asks for the requeue itself
# (requeue("auto") runs scontrol requeue). The srun layout's path (exit 75, the batch shell
# requeues; requeue("auto") only says so) is the one a script on hpc_ddp.Preemption takes too:
# test_example_script.py's Slurm job, at world 4 as well. Under submitit, Resumable's Preemption
# and requeue("auto") are that script's: test_example_script.py's submitit job.
def _render(cwd: Path, launcher: str) -> Path:
    job = cwd / "job.sbatch"
    res = hpc_ddp(
        ["render", "--name", f"resumable-{launcher}", "--nodes", "2", "--procs-per-node", "2",
         "--launcher", launcher, "--time", "5", "--signal-lead-s", "60", "--python",
         sys.executable, "--script", SLOW, "--script-out", str(job), "--",
         "0.1", str(RESUMABLE), *EPOCHS, "--run-dir", str(cwd / "run")]
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    return job


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_torchrun_layout_preempted_requeued_resumes_bit_identical(
    slurm_cluster, reference: dict[int, str], tmp_path: Path
) -> None:
    """A real `scancel --signal=USR1` once epoch 1 is printed, in the torchrun layout: rank 0
    runs scontrol requeue, Slurm restarts the job, which resumes and ends with the
    uninterrupted run's weights."""
    job_id, log = slurm_cluster.sbatch(
        _render(tmp_path, "torchrun"), output=tmp_path / "job.out", cwd=tmp_path
    )
    wait_for(lambda: log.exists() and "epoch 1:" in log.read_text(), 120, "epoch 1")
    slurm_cluster.run(["scancel", "--signal=USR1", job_id])
    wait_for(
        lambda: slurm_cluster.job_state(job_id) in TERMINAL
        and (tmp_path / "run" / "model.pt").exists(),
        240, f"job {job_id} to end",
    )  # fmt: skip
    info, text = slurm_cluster.job_info(job_id), log.read_text()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), text
    assert PREEMPTED.search(text) and "resumed from" in text, text
    assert f"requeued Slurm job {job_id} (scontrol requeue)" in text, text  # rank 0 asked
    assert _sha(tmp_path / "run") == reference[4]
