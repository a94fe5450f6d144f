"""The default command on CPU, then the same command again: answered from the run dir, no torch.

Real processes throughout: the first run is what a user types (defaults, ``--nproc-per-node 2``:
two forked Gloo ranks, tiny synthetic data), a correctness check of the CPU start-up, not a
timed test. The re-runs start with a ``sitecustomize`` that makes ``import torch`` fail, so a
re-run that answers has answered without torch (and without workers, which need it). Fewer
epochs get the same answer; more continue the run, on the schedule of the new end.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import (
    HPC_DDP,
    assert_resumed_like,
    forked_cmd,
    interrupt_at,
    job_env,
    read_result,
    reference_run,
    train_args,
)
from trainer_helpers import run as run_cmd

from hpc_ddp.exit_codes import EXIT_REQUEUE
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
    cmd = module_cmd(*train_args(run_dir, data_dir, seed=1))
    blocked = run(cmd, torch_blocked=True, tmp=tmp_path)
    assert blocked.returncode != 0 and "already finished" not in blocked.stdout
    assert "blocked by the test's sitecustomize" in blocked.stderr  # it went for the trainer
    refused = run(cmd, torch_blocked=False, tmp=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "holds a run with different settings (seed: 0 -> 1)" in refused.stderr
    assert read_result(run_dir)["epochs"] == 2  # nothing overwritten


def test_fewer_epochs_than_the_run_trained_get_the_answer_and_say_so(
    finished: tuple[Path, str], data_dir: Path, tmp_path: Path
) -> None:
    run_dir, first_out = finished
    fewer = run(
        module_cmd(*train_args(run_dir, data_dir, epochs=1)), torch_blocked=True, tmp=tmp_path
    )
    assert fewer.returncode == 0, fewer.stderr
    lines = fewer.stdout.splitlines()
    assert lines[0] == f"run dir {run_dir} already finished (result.json); nothing to do"
    assert lines[1] == (
        "(--epochs 1 is fewer than the 2 it trained: a finished run is never cut back; more "
        "epochs than it trained continue it)"
    )
    assert result_block(fewer.stdout) == result_block(first_out)


# The schedule of a run continued to more epochs: a constant rate after a warm-up that crosses
# the old end depends on the step alone, never on the total steps.
CONSTANT = {"lr_schedule": "constant", "warmup_steps": 12}


@pytest.mark.slow
def test_more_epochs_continue_a_finished_run_to_the_weights_of_a_run_started_with_them(
    tmp_path: Path, data_dir: Path
) -> None:
    """1 epoch (8 steps), then --epochs 2, interrupted at step 12 and resumed: bit for bit the
    weights and loss curve of a run started with --epochs 2."""
    ref = reference_run(tmp_path / "ref", data_dir, epochs=2, **CONSTANT)
    run_dir = tmp_path / "run"
    first = run_cmd(forked_cmd(2, train_args(run_dir, data_dir, epochs=1, **CONSTANT)))
    assert first.returncode == 0, first.stderr

    args = train_args(run_dir, data_dir, epochs=2, **CONSTANT)
    hold = forked_cmd(2, [*args, "--debug-hold-at-step", "12"])
    rc, log = interrupt_at(hold, run_dir, tmp_path / "more.log")
    assert rc == EXIT_REQUEUE, log
    assert f"run dir {run_dir} finished 1 epoch(s) (result.json); --epochs 2 continues it" in log
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000008'} (epoch 2, 0 samples" in log
    # Its first checkpoint (step 12's) is newer than the finished state: result.json is gone.
    assert not (run_dir / "result.json").exists()

    fewer = run_cmd(forked_cmd(2, train_args(run_dir, data_dir, epochs=1, **CONSTANT)))
    assert fewer.returncode == 2, fewer.stderr
    assert "is at step 12 in epoch 2, past --epochs 1" in fewer.stderr
    assert "HINT: give --epochs 2 or more" in fewer.stderr

    done = run_cmd(forked_cmd(2, args))
    assert done.returncode == 0, done.stderr
    assert_resumed_like(run_dir, ref, interruptions=2, steps=16)


def test_more_epochs_on_a_cosine_schedule_follow_the_new_end_from_the_restored_step(
    finished: tuple[Path, str], data_dir: Path, tmp_path: Path
) -> None:
    """The cosine decays to 0 at the end it was built for: continued from 1 epoch to 2, the run
    takes the 2-epoch cosine from step 8 on (lr 0.0005 where the 1-epoch run ended at 0), so it
    cannot end as the run started with --epochs 2 (the fixture), whose first epoch already had
    the 2-epoch schedule."""
    ref_dir, _ = finished
    run_dir = tmp_path / "run"
    for epochs in (1, 2):
        cmd = module_cmd("--nproc-per-node", "2", *train_args(run_dir, data_dir, epochs=epochs))
        done = run(cmd, torch_blocked=False, tmp=tmp_path)
        assert done.returncode == 0, done.stderr
    assert (
        "lr: 0.0005 at step 8 on this run's schedule (cosine over 16 steps, 2 epochs), where "
        "the checkpoint has 0" in done.stdout
    ), done.stdout
    result, reference = read_result(run_dir), read_result(ref_dir)
    assert (result["epochs"], result["steps"]) == (reference["epochs"], reference["steps"])
    assert result["params_sha256"] != reference["params_sha256"]


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
