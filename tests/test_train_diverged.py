"""A loss that becomes NaN or infinite stops every rank at the same step with EXIT_DIVERGED, and
the newest checkpoint stays the last finite state.

Real processes throughout: two Gloo ranks forked by ``hpc-ddp train --nproc-per-node 2``, and a
process alone. A plug-in model (a .py file written here) makes the numbers go bad at a known
step, as a too-high learning rate does at an unknown one: its output turns NaN at its 11th
training forward, or only its gradients at its 12th backward, which leaves that step's loss
finite and the weights NaN (only the check of the state before a checkpoint sees that). And a
real ``--lr 100``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from cli_forkserver import ForkedCli
from trainer_helpers import forked_cmd, read_json, read_metrics, run, train_args

from hpc_ddp.exit_codes import EXIT_DIVERGED

PLUGIN = '''
import torch
from torch import nn


class NanGrad(torch.autograd.Function):
    """The identity, whose gradient is NaN."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class GoesBad(nn.Module):
    """A linear classifier of CIFAR images whose ``step``-th training forward (one per optimizer
    step: accum_steps 1) gives a NaN output, or a finite output with a NaN gradient."""

    def __init__(self, num_classes, step, what):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, num_classes))
        self.step, self.what, self.calls = step, what, 0

    def forward(self, x):
        out = self.body(x)
        if self.training:
            self.calls += 1
            if self.calls == self.step:
                out = out * float("nan") if self.what == "output" else NanGrad.apply(out)
        return out


def nan_loss_at_11(num_classes):
    return GoesBad(num_classes, 11, "output")


def nan_update_at_12(num_classes):
    return GoesBad(num_classes, 12, "gradient")
'''


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    path = tmp_path / "goes_bad.py"
    path.write_text(PLUGIN)
    return path


def step_dirs(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))


def assert_finite_checkpoints(run_dir: Path) -> None:
    for name in step_dirs(run_dir):
        shared = torch.load(run_dir / "checkpoints" / name / "shared.pt", weights_only=True)
        for key, tensor in shared["model"].items():
            assert torch.isfinite(tensor).all(), f"{name}: {key} is not finite"
        for state in shared["optimizer"]["state"].values():
            assert all(torch.isfinite(v).all() for v in state.values()), name


def test_two_ranks_stop_together_at_a_nan_loss_keeping_the_last_finite_checkpoint(
    tmp_path: Path, data_dir: Path, plugin: Path
) -> None:
    """8 steps per epoch, checkpoints at steps 4 and 8 and every 4 steps on (keep 2): the loss
    is NaN from step 11 on, so the checkpoint of step 12 would hold NaN weights and prune step
    4's. Both ranks stop at the sync point that reads step 11's loss, and nothing is saved."""
    run_dir = tmp_path / "run"
    args = train_args(
        run_dir, data_dir, model=f"{plugin}:nan_loss_at_11", epochs=3,
        checkpoint_every_steps=4, checkpoint_interval_s=0, keep_checkpoints=2,
    )  # fmt: skip
    done = run(forked_cmd(2, args))
    assert done.returncode == EXIT_DIVERGED, done.stdout + done.stderr
    newest = run_dir / "checkpoints" / "step-00000008"
    for rank in (0, 1):  # each rank says why it stopped, and where the last finite state is
        assert (
            f"[rank {rank}/2 " in done.stderr
            and "training diverged: the training loss became nan at step 11 (epoch 2)"
            in done.stderr
        ), done.stderr
    assert f"The newest checkpoint, {newest}, holds the last finite state" in done.stderr
    assert "HINT: try a lower --lr (this run: 0.001)" in done.stderr
    # The ranks left together: the launcher did not stop one as a failed rank's peer.
    assert "stopping the other" not in done.stderr, done.stderr

    assert step_dirs(run_dir) == ["step-00000004", "step-00000008"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000008\n"
    assert_finite_checkpoints(run_dir)
    progress = read_json(run_dir / "progress.json")
    assert progress["status"] == "diverged" and progress["diverged_at_step"] == 11
    assert progress["checkpoint"] == str(newest) and progress["world_size"] == 2
    assert "the training loss became nan at step 11" in progress["reason"]
    assert not (run_dir / "result.json").exists()  # not finished
    rows = read_metrics(run_dir)
    assert [row["epoch"] for row in rows] == [1] and all(
        math.isfinite(row["train_loss"]) for row in rows
    )


def test_one_process_never_checkpoints_weights_a_finite_loss_left_nan(
    tmp_path: Path, data_dir: Path, plugin: Path, train_cli: ForkedCli
) -> None:
    """Step 12's loss is finite, its update makes the weights NaN, and step 12 is a checkpoint
    step: the state check before the save stops the run there, keeping steps 4 and 8."""
    run_dir = tmp_path / "run"
    args = train_args(
        run_dir, data_dir, model=f"{plugin}:nan_update_at_12", epochs=1,
        checkpoint_every_steps=4, keep_checkpoints=2,
    )  # fmt: skip
    done = train_cli.run(["train", *args])
    assert done.returncode == EXIT_DIVERGED, done.stdout + done.stderr
    assert (
        "training diverged: the weights or the optimizer state became NaN or infinite at step "
        "12 (epoch 1); every rank stopped there." in done.stderr
    ), done.stderr
    assert step_dirs(run_dir) == ["step-00000004", "step-00000008"]
    assert_finite_checkpoints(run_dir)
    progress = read_json(run_dir / "progress.json")
    assert (progress["status"], progress["diverged_at_step"]) == ("diverged", 12)


def test_a_learning_rate_that_diverges_exits_with_its_own_code(
    tmp_path: Path, data_dir: Path, train_cli: ForkedCli
) -> None:
    """LeNet at --lr 100 (the most --lr takes): the weights are infinite within the first
    epoch, caught at the latest by the check before its first checkpoint."""
    run_dir = tmp_path / "run"
    done = train_cli.run(["train", *train_args(run_dir, data_dir, lr=100, epochs=1, log_every=1)])
    assert done.returncode == EXIT_DIVERGED, done.stdout + done.stderr
    assert "error: training diverged: the " in done.stderr
    assert "No checkpoint was written before it." in done.stderr
    assert "HINT: try a lower --lr (this run: 100), a warm-up (--warmup-steps" in done.stderr
    assert step_dirs(run_dir) == [] and not (run_dir / "result.json").exists()
    assert read_json(run_dir / "progress.json")["status"] == "diverged"
