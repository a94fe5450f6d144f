"""The epoch-end saving policy: every epoch when epochs are long, one per checkpoint_interval_s
of training when they are short; the last epoch and preemptions always. Units, then 2 real
Gloo ranks (the decision must be the same on every rank, or a save's
collectives would hang)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from trainer_helpers import (
    assert_resumed_like,
    forked_cmd,
    interrupt_at,
    reference_run,
    run,
    train_args,
)

from hpc_ddp.errors import ConfigError
from hpc_ddp.train.config import TrainConfig
from hpc_ddp.train.trainer import EpochEndSaves


def test_short_epochs_save_once_the_interval_has_passed() -> None:
    saves = EpochEndSaves(1.0)  # 8 steps of 0.05 s: 0.4 s of training per epoch
    decided = []
    assert not saves.due(8, 0.05, final=False) and saves.trained_s == pytest.approx(0.4)
    for step in range(8, 81, 8):
        due = saves.due(step, 0.05, final=step == 80)
        if due:
            saves.saved(step)
        decided.append(due)
    # 1 s of training = 20 steps: saved at 24, 48, 72 and the last epoch's 80
    assert decided == [False, False, True, False, False, True, False, False, True, True]


def test_long_epochs_unknown_pace_interval_zero_and_the_last_epoch_always_save() -> None:
    assert EpochEndSaves(1.0).due(100, 0.02, final=False)  # a 2-s epoch
    assert EpochEndSaves(1.0).due(8, -1.0, final=False)  # pace not agreed yet
    assert EpochEndSaves(0.0).due(1, 1e-6, final=False)  # 0: every epoch end
    assert EpochEndSaves(1e9).due(8, 0.01, final=True)
    saves = EpochEndSaves(1.0, since_step=100)  # resumed at step 100: counted from there
    assert not saves.due(140, 0.02, final=False) and saves.due(150, 0.02, final=False)


def test_the_one_line_about_thinned_saves_is_said_once() -> None:
    saves = EpochEndSaves(1.0)
    assert [saves.first_skip() for _ in range(3)] == [True, False, False]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_bad_interval_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match="checkpoint_interval_s"):
        TrainConfig(checkpoint_interval_s=bad).validate()


def _saved_steps(log: str) -> list[int]:
    return [int(s) for s in re.findall(r"checkpoint: saved \S*/step-(\d+)", log)]


def test_two_ranks_skip_short_epochs_alike_and_save_the_last(
    tmp_path: Path, data_dir: Path
) -> None:
    """3 epochs of 8 steps with a 1000-s interval: only the last epoch's end is saved, on both
    ranks alike (the run ends instead of hanging in a save one rank skipped), said once; with
    0, every epoch end is."""
    thinned = run(
        forked_cmd(2, train_args(tmp_path / "a", data_dir, epochs=3, checkpoint_interval_s=1000))
    )
    assert thinned.returncode == 0, thinned.stderr
    out = thinned.stdout + thinned.stderr
    assert _saved_steps(out) == [24], out
    said = re.findall(r"checkpoint: none at the end of epoch (\d): [\d.]+ s of training since the "
                      r"newest \(step 0\), under checkpoint_interval_s=1000;", out)  # fmt: skip
    assert said == ["1"], out  # once, though epoch 2 skipped too
    every = run(
        forked_cmd(2, train_args(tmp_path / "b", data_dir, epochs=3, checkpoint_interval_s=0))
    )
    assert every.returncode == 0, every.stderr
    assert _saved_steps(every.stdout + every.stderr) == [8, 16, 24]


def test_a_preemption_after_skipped_epoch_ends_still_saves_and_resumes_exactly(
    tmp_path: Path, data_dir: Path
) -> None:
    """Epoch 1's end is skipped; SIGUSR1 at step 11 (epoch 2) checkpoints there, and the rerun
    ends bit-identical to an uninterrupted run."""
    ref = reference_run(tmp_path / "ref", data_dir, checkpoint_interval_s=0)
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir, checkpoint_interval_s=1000)
    rc, log = interrupt_at(
        forked_cmd(2, [*args, "--debug-hold-at-step", "11"]), run_dir, tmp_path / "1.log"
    )
    assert rc == 75 and "preempted (SIGUSR1): checkpointed at step 11" in log, log
    assert _saved_steps(log) == [11], log
    final = run(forked_cmd(2, args))
    assert final.returncode == 0, final.stderr
    assert_resumed_like(run_dir, ref, interruptions=1, steps=16)
