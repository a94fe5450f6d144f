"""The default command on CPU, then the same command again: answered from the run dir, no torch.

Real processes throughout: the first run is what a user types (defaults, ``--nproc-per-node 2``:
two forked Gloo ranks, tiny synthetic data), a correctness check of the CPU start-up, not a
timed test. The re-runs start with a ``sitecustomize`` that makes ``import torch`` fail, so a
re-run that answers has answered without torch (and without workers, which need it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import HPC_DDP, job_env, read_result, train_args

from hpc_ddp.spawn import worker_environ

NO_TORCH = '''import sys


class NoTorch:
    """Fails every import of torch: the test needs proof that nothing imported it."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"import {name}: blocked by the test's sitecustomize")


sys.meta_path.insert(0, NoTorch())
'''


def module_cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "hpc_ddp.train", *argv]


def run(cmd: list[str], *, torch_blocked: bool, tmp: Path, **env: str):
    full = job_env(**env)
    if torch_blocked:
        blocker = tmp / "no-torch"
        blocker.mkdir(exist_ok=True)
        (blocker / "sitecustomize.py").write_text(NO_TORCH)
        full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(blocker), full.get("PYTHONPATH")]))
    return subprocess.run(cmd, env=full, capture_output=True, text=True, timeout=180, check=False)


def result_block(stdout: str) -> list[str]:
    """``result (<run-dir>/result.json):`` and its indented lines."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("result ("))
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        block.append(line)
    return block


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> tuple[Path, str]:
    """The default command, 2 ranks on the CPU, run to the end: (run dir, its stdout)."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    first = run(
        module_cmd("--nproc-per-node", "2", *train_args(run_dir, data_dir)),
        torch_blocked=False,
        tmp=run_dir.parent,
    )
    assert first.returncode == 0, first.stderr
    return run_dir, first.stdout


def test_the_default_command_trains_on_two_cpu_ranks(finished: tuple[Path, str]) -> None:
    run_dir, out = finished
    result = read_result(run_dir)
    assert result["status"] == "finished" and result["world_size"] == 2 and result["steps"] == 16
    assert result["test_accuracy"] > 0.5, result  # the easy synthetic data is learnt
    assert not result["extra"]["cuda_graphs"]
    # Said once (rank 0), and why: there is no GPU.
    assert out.count("CUDA graphs: off") == 1, out
    assert "CUDA graphs: off (device cpu is not a CUDA GPU)" in out
    block = result_block(out)
    assert block[0] == f"result ({run_dir / 'result.json'}):"
    assert f"  params_sha256: {result['params_sha256']}" in block


@pytest.mark.parametrize(
    "launch",
    [["hpc-ddp"], ["python -m"], ["python -m", "--nproc-per-node", "2"]],
    ids=["hpc-ddp-train", "python-m", "nproc-per-node-2"],
)
def test_the_same_command_again_answers_without_torch(
    finished: tuple[Path, str], data_dir: Path, tmp_path: Path, launch: list[str]
) -> None:
    run_dir, first_out = finished
    flags = [*launch[1:], *train_args(run_dir, data_dir)]
    cmd = [HPC_DDP, "train", *flags] if launch[0] == "hpc-ddp" else module_cmd(*flags)
    again = run(cmd, torch_blocked=True, tmp=tmp_path)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert lines[0] == f"run dir {run_dir} already finished (result.json); nothing to do"
    assert result_block(again.stdout) == result_block(first_out)  # what the run printed


def test_settings_that_are_not_the_run_identity_still_get_the_answer(
    finished: tuple[Path, str], data_dir: Path, tmp_path: Path
) -> None:
    run_dir, first_out = finished
    other = ["--log-every", "3", "--no-async-checkpoint", "--no-cuda-graphs", "--num-workers", "1"]
    again = run(
        module_cmd(*train_args(run_dir, data_dir), *other), torch_blocked=True, tmp=tmp_path
    )
    assert again.returncode == 0, again.stderr
    assert result_block(again.stdout) == result_block(first_out)


def test_changed_identity_settings_are_refused_by_the_trainer_as_before(
    finished: tuple[Path, str], data_dir: Path, tmp_path: Path
) -> None:
    run_dir, _ = finished
    cmd = module_cmd(*train_args(run_dir, data_dir, epochs=3))
    blocked = run(cmd, torch_blocked=True, tmp=tmp_path)
    assert blocked.returncode != 0 and "already finished" not in blocked.stdout
    assert "blocked by the test's sitecustomize" in blocked.stderr  # it went for the trainer
    refused = run(cmd, torch_blocked=False, tmp=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "holds a run with different settings (epochs: 2 -> 3)" in refused.stderr
    assert read_result(run_dir)["epochs"] == 2  # nothing overwritten


def test_a_rank_of_a_larger_launch_leaves_the_answer_to_the_ranks_together(
    finished: tuple[Path, str], data_dir: Path, tmp_path: Path
) -> None:
    """Rank 0 of 2 (a launcher's variables): its peers may not see the run dir the same way, so
    it does not answer alone; the trainer decides through the process group, with torch."""
    run_dir, _ = finished
    launcher = worker_environ(0, 2, 29500, 1)
    done = run(
        module_cmd(*train_args(run_dir, data_dir)), torch_blocked=True, tmp=tmp_path, **launcher
    )
    assert done.returncode != 0 and "already finished" not in done.stdout
    assert "blocked by the test's sitecustomize" in done.stderr
