"""Asynchronous checkpoints (``--async-checkpoint``): snapshot, background commit, errors.

In-process tests drive ``Checkpointer.save_async`` with phase hooks (no timing); the trainer
tests run two real Gloo ranks (forked: ``forked_cmd``; the run that fails its background write
under torchrun) and compare against the synchronous path.
"""

from __future__ import annotations

import errno
import json
import resource
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from trainer_helpers import (
    assert_resumed_like,
    forked_cmd,
    interrupt_at,
    job_env,
    python_cmd,
    read_result,
    reference_run,
    run,
    torchrun_cmd,
    train_args,
)

from hpc_ddp.checkpoint import Checkpointer, CheckpointError, UnsafeCheckpointContentError
from hpc_ddp.checkpoint.asyncsave import SaveWorker, pin_pieces, start_snapshot
from hpc_ddp.slurm_client import wait_for

DEADLINE_S = 60


def model(value: float) -> dict:
    return {"model": OrderedDict(w=torch.full((8,), value), b=torch.zeros(2))}


def entries(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ------------------------------------------------------------------ in-process (world size 1)
def test_save_returns_while_the_background_write_is_still_running(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    writing, release = threading.Event(), threading.Event()

    def on_phase(phase: str) -> None:
        if phase == "writing" and threading.current_thread() is not threading.main_thread():
            writing.set()
            if not release.wait(DEADLINE_S):
                raise TimeoutError("the test never released the background write")

    ck = Checkpointer(root, rank=0, world_size=1, log=lambda _: None, on_phase=on_phase)
    state = model(1.0)
    rng = {"torch": torch.get_rng_state()}
    ck.save_async(7, shared=state, per_rank=rng, meta={"epoch": 0})
    # save_async has returned; the background thread is inside the write phase, blocked.
    assert writing.wait(DEADLINE_S), "the background save never reached the write phase"
    assert ck.in_flight
    assert not (root / "step-00000007").exists() and not (root / "latest").exists()
    state["model"]["w"].add_(100.0)  # training goes on mutating the live state
    release.set()
    final = ck.wait()
    assert final == root / "step-00000007" and not ck.in_flight
    assert (root / "latest").read_text() == "step-00000007\n"
    loaded = ck.load_latest()
    assert torch.equal(loaded.shared["model"]["w"], torch.full((8,), 1.0))  # the snapshot
    assert torch.equal(loaded.per_rank["torch"], rng["torch"])
    assert ck.wait() is None  # nothing in flight any more


def test_a_failed_background_save_raises_at_the_next_wait_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpt"
    fail = {"on": False}

    def on_phase(phase: str) -> None:
        if fail["on"] and phase == "written":
            raise OSError(errno.EIO, "injected I/O error")

    ck = Checkpointer(root, rank=0, world_size=1, log=lambda _: None, on_phase=on_phase)
    ck.save(10, shared=model(10.0), per_rank={}, meta={})
    fail["on"] = True
    ck.save_async(20, shared=model(20.0), per_rank={}, meta={})  # returns: the error is later
    with pytest.raises(OSError, match="injected I/O error"):
        ck.save_async(30, shared=model(30.0), per_rank={}, meta={})  # waits first: raises
    assert (root / "latest").read_text() == "step-00000010\n"
    assert entries(root) == ["latest", "step-00000010"]  # no .tmp-step-00000020, no step-20
    fail["on"] = False
    ck.save_async(30, shared=model(30.0), per_rank={}, meta={})  # the error was reported once
    assert ck.wait() == root / "step-00000030"
    assert ck.load_latest().step == 30


def test_unsafe_state_is_refused_by_the_background_save(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ck = Checkpointer(root, rank=0, world_size=1, log=lambda _: None)
    ck.save_async(1, shared=model(1.0), per_rank={"np": np.zeros(3)}, meta={})
    with pytest.raises(UnsafeCheckpointContentError, match="numpy"):
        ck.wait()
    assert not (root / "latest").exists() and entries(root) == []


def test_overlapping_saves_of_two_checkpointers_restore_the_interval(tmp_path: Path) -> None:
    """Two Checkpointers' background saves overlap (each has its own thread), the first ending
    while the second writes: the interpreter's switch interval stays the saves' while either
    runs, and is the one from before once both end. Each restoring "its" previous value put the
    default back under the second save, then left the saves' interval in force for ever."""
    before = sys.getswitchinterval()
    second_writing, first_done = threading.Event(), threading.Event()
    seen: list[float] = []

    def hold_second(phase: str) -> None:
        if phase == "writing":
            second_writing.set()
            assert first_done.wait(60)  # the first save ends while this one writes
            seen.append(sys.getswitchinterval())

    one = Checkpointer(tmp_path / "a", rank=0, world_size=1, log=lambda _: None)
    two = Checkpointer(
        tmp_path / "b", rank=0, world_size=1, log=lambda _: None, on_phase=hold_second
    )
    hold = threading.Event()
    one_started = threading.Event()

    def hold_first(phase: str) -> None:
        if phase == "writing":
            one_started.set()
            assert hold.wait(60)

    one._on_phase = hold_first
    one.save_async(1, shared=model(1.0), per_rank={}, meta={})
    assert one_started.wait(60)
    two.save_async(1, shared=model(2.0), per_rank={}, meta={})
    assert second_writing.wait(60)
    hold.set()
    one.wait()
    first_done.set()
    two.wait()
    assert seen == [SaveWorker.SWITCH_INTERVAL_S]
    # wait() returns once the save is done; its thread leaves the interval's block just after.
    wait_for(lambda: sys.getswitchinterval() == before, 10, "the interval from before")


def test_background_saves_share_one_thread_which_ends_when_idle_and_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saves run in order on one kept thread (no thread start on the training path after the
    first); idle for SaveWorker.IDLE_S it ends, and the next save starts it again. While a save
    runs the interpreter switches threads every SWITCH_INTERVAL_S; Python's interval after."""
    monkeypatch.setattr(SaveWorker, "IDLE_S", 0.2)
    threads: list[threading.Thread] = []
    intervals: list[float] = []
    before = sys.getswitchinterval()

    def on_phase(phase: str) -> None:
        if phase == "writing":
            threads.append(threading.current_thread())
            intervals.append(sys.getswitchinterval())

    ck = Checkpointer(
        tmp_path / "ckpt", rank=0, world_size=1, log=lambda _: None, on_phase=on_phase
    )
    for step in (1, 2, 3):
        ck.save_async(step, shared=model(float(step)), per_rank={}, meta={})
    assert ck.wait() == tmp_path / "ckpt" / "step-00000003"
    first = threads[0]
    assert threads == [first] * 3 and first is not threading.main_thread()
    assert intervals == [SaveWorker.SWITCH_INTERVAL_S] * 3 != [before] * 3
    first.join(DEADLINE_S)  # ends on its own once idle (a deadline, not a sleep)
    assert not first.is_alive(), "the idle save thread did not end"
    ck.save_async(4, shared=model(4.0), per_rank={}, meta={})
    assert ck.wait() == tmp_path / "ckpt" / "step-00000004"
    assert threads[3] is not first and threads[3].name == first.name == "hpc-ddp-checkpoint-rank0"
    assert torch.equal(ck.load_latest().shared["model"]["w"], torch.full((8,), 4.0))
    threads[3].join(DEADLINE_S)  # idle again: ended, the interval given back
    assert not threads[3].is_alive() and sys.getswitchinterval() == before


def test_a_staged_part_is_copied_when_staged_and_saved_with_the_rest(tmp_path: Path) -> None:
    """Checkpointer.stage copies its part at once (later changes do not reach it); save_async
    writes it with the rest of ``shared``; a step or key mismatch is refused, nothing saved."""
    ck = Checkpointer(tmp_path / "ckpt", rank=0, world_size=1, log=lambda _: None)
    live = model(1.0)
    staged = ck.stage(5, live)
    live["model"]["w"].add_(100.0)  # evaluation would not, but nothing may reach the copy
    with pytest.raises(CheckpointError, match="staged for step 5 given to step 6"):
        ck.save_async(6, shared={"progress": {}}, per_rank={}, meta={}, staged=staged)
    with pytest.raises(CheckpointError, match=r"both staged and given: \['model'\]"):
        ck.save_async(5, shared=model(2.0), per_rank={}, meta={}, staged=staged)
    assert ck.load_latest() is None
    ck.save_async(5, shared={"progress": {"epoch": 1}}, per_rank={}, meta={}, staged=staged)
    loaded = ck.load_latest()
    assert loaded.step == 5 and loaded.shared["progress"] == {"epoch": 1}
    assert torch.equal(loaded.shared["model"]["w"], torch.full((8,), 1.0))


def test_snapshot_copies_every_tensor_and_keeps_container_types() -> None:
    live = {"m": OrderedDict(w=torch.ones(3)), "l": [torch.zeros(2), 1.5], "t": (1, "a")}
    snap = start_snapshot(live).ready()
    assert type(snap["m"]) is OrderedDict and type(snap["t"]) is tuple and snap["t"] == (1, "a")
    live["m"]["w"].add_(1)
    live["l"][0].add_(1)
    assert torch.equal(snap["m"]["w"], torch.ones(3)) and torch.equal(snap["l"][0], torch.zeros(2))
    assert snap["m"]["w"].data_ptr() != live["m"]["w"].data_ptr()


def test_pinned_memory_is_taken_in_pieces_of_whole_tensors_under_the_limit() -> None:
    """A first save pins its pack piece by piece (CUDA holds up the training thread's launches
    while it pins): never a piece over the limit unless one tensor alone is; every tensor in
    exactly one piece, in order. The GPU test checks the values the pieces hold."""
    assert pin_pieces([4, 4, 4, 4], 8) == [(0, 2), (2, 4)]
    assert pin_pieces([3, 20, 3, 3, 0], 8) == [(0, 1), (1, 2), (2, 5)]
    assert pin_pieces([20], 8) == [(0, 1)] and pin_pieces([], 8) == []
    sizes = [(i * 37) % 41 for i in range(200)]  # 0-40 bytes, in no order
    pieces = pin_pieces(sizes, 64)
    assert [i for a, b in pieces for i in range(a, b)] == list(range(len(sizes)))
    assert all(sum(sizes[a:b]) <= 64 for a, b in pieces)


# ------------------------------------------------------------------ trainer: 2 Gloo ranks
EVERY = {"checkpoint_every_steps": 2}


@pytest.fixture(scope="module")
def sync_reference(tmp_path_factory: pytest.TempPathFactory, data_dir: Path) -> Path:
    """Uninterrupted, synchronous saves: 8 steps/epoch, 2 epochs, a checkpoint every 2 steps."""
    ref_dir = tmp_path_factory.mktemp("sync") / "run"
    reference_run(ref_dir, data_dir, **EVERY)
    return ref_dir


def _latest(run_dir: Path) -> Path:
    root = run_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def assert_same(a: object, b: object, where: str = "") -> None:
    """Exactly equal, recursively: tensors bit for bit (dtype and shape included)."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# Progress fields that measure time differ between any two runs; everything else must not.
TIMING = {"epoch_times", "train_seconds", "wall_seconds", "train_wall_seconds"}
ROW_TIMING = {"seconds", "time", "samples_per_second"}


def test_async_and_sync_runs_write_identical_weights_and_checkpoints(
    tmp_path: Path, data_dir: Path, sync_reference: Path
) -> None:
    run_dir = tmp_path / "run"
    done = run(forked_cmd(2, train_args(run_dir, data_dir, async_checkpoint=True, **EVERY)))
    assert done.returncode == 0, done.stderr
    ours, ref = read_result(run_dir), read_result(sync_reference)
    assert ours["steps"] == ref["steps"] == 16
    assert ours["params_sha256"] == ref["params_sha256"]
    assert entries(run_dir / "checkpoints") == entries(sync_reference / "checkpoints")

    a, s = _latest(run_dir), _latest(sync_reference)
    assert a.name == s.name == "step-00000016"
    sa, ss = _load(a / "shared.pt"), _load(s / "shared.pt")
    for key in ("model", "optimizer", "scheduler", "scaler"):
        assert_same(sa[key], ss[key], key)
    pa, ps = sa["progress"], ss["progress"]
    rows = {"history", "last_log"}  # metrics rows: their timings differ, nothing else
    assert {k: v for k, v in pa.items() if k not in TIMING | rows} == {
        k: v for k, v in ps.items() if k not in TIMING | rows
    }

    for a_rows, s_rows in ((pa["history"], ps["history"]), ([pa["last_log"]], [ps["last_log"]])):
        strip = [{k: v for k, v in row.items() if k not in ROW_TIMING} for row in a_rows]
        assert strip == [{k: v for k, v in row.items() if k not in ROW_TIMING} for row in s_rows]
    for rank in (0, 1):
        name = f"rank-{rank:05d}.pt"
        assert_same(_load(a / name), _load(s / name), name)


@pytest.mark.slow
def test_sigusr1_with_an_async_save_in_flight_resumes_bit_for_bit(
    tmp_path: Path, data_dir: Path, sync_reference: Path
) -> None:
    """A checkpoint every step: the signal may find the previous step's save still in flight."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir, async_checkpoint=True, checkpoint_every_steps=1)
    rc, log = interrupt_at(
        forked_cmd(2, [*args, "--debug-hold-at-step", "5"]), run_dir, tmp_path / "1.log"
    )
    assert rc == 75 and "preempted (SIGUSR1): checkpointed at step 5" in log, log
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-00000005\n"

    final = run(forked_cmd(2, args))
    assert final.returncode == 0, final.stderr
    assert "step 5)" in final.stdout  # resumed from the preemption checkpoint
    assert_resumed_like(run_dir, sync_reference, interruptions=1, steps=16)


@pytest.mark.slow
def test_a_failing_background_write_fails_the_run_and_keeps_latest(
    tmp_path: Path, data_dir: Path, sync_reference: Path
) -> None:
    """RLIMIT_FSIZE (128 KiB) on the whole job: the per-rank files fit, rank 0's shared.pt
    (0.5 MiB) fails with EFBIG in the background; the run must die at the next save."""
    run_dir = tmp_path / "run"
    args = train_args(run_dir, data_dir, async_checkpoint=True, **EVERY)
    rc, log = interrupt_at(
        forked_cmd(2, [*args, "--debug-hold-at-step", "3"]), run_dir, tmp_path / "1.log"
    )
    assert rc == 75 and "checkpointed at step 3" in log, log
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text() == "step-00000003\n"

    def limit_file_size() -> None:  # Python ignores SIGXFSZ: the write fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (128 << 10, 128 << 10))

    failed = subprocess.run(
        torchrun_cmd(2, args),
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=limit_file_size,
    )
    err = failed.stderr
    assert failed.returncode != 0, err
    assert "[rank 0/2" in err and "EFBIG" in err and "shared.pt" in err, err
    assert "[rank 1/2" in err and "rank(s) 0 failed in the write phase" in err, err
    assert "saved" not in failed.stdout.split("resumed from")[-1], failed.stdout
    assert (root / "latest").read_text() == "step-00000003\n"
    assert entries(root) == ["latest", "step-00000002", "step-00000003"]  # no tmp, no step-4
    assert not (run_dir / "result.json").exists()


def test_the_flag_defaults_to_on_and_parses() -> None:
    import argparse

    from hpc_ddp.train import config

    assert config.TrainConfig().async_checkpoint is True
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    assert config.from_args(parser.parse_args(["--no-async-checkpoint"])).async_checkpoint is False
    assert config.from_args(parser.parse_args([])).async_checkpoint is True


# ------------------------------------------------ the default run reports only committed saves
SLOW_COMMIT = str(Path(__file__).parent / "workers" / "slow_commit_train.py")


def _reports(run_dir: Path) -> list[dict]:
    lines = (run_dir / "reports.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


@pytest.mark.slow
def test_success_and_preemption_are_reported_only_after_the_background_commit(
    tmp_path: Path, data_dir: Path
) -> None:
    """Default settings (background saves), 2 forked Gloo ranks, each commit slowed by 1 s
    (workers/slow_commit_train.py). At the moment the run writes result.json, and at the moment
    a preempted run requeues (before exit 75), ``latest`` already names the checkpoint of the
    last step: the report waited for the write."""
    run_dir = tmp_path / "run"
    args = ["--nproc-per-node", "2", *train_args(run_dir, data_dir)]
    hold = python_cmd(SLOW_COMMIT, [*args, "--debug-hold-at-step", "5"])
    rc, log = interrupt_at(hold, run_dir, tmp_path / "1.log")
    assert rc == 75 and "preempted (SIGUSR1): checkpointed at step 5" in log, log
    assert _reports(run_dir) == [{"event": "requeue", "latest": "step-00000005"}]

    done = run(python_cmd(SLOW_COMMIT, args))
    assert done.returncode == 0, done.stderr
    assert "background save" not in done.stdout + done.stderr  # no save failed
    reports = _reports(run_dir)[1:]
    assert reports == [{"event": "result", "latest": "step-00000016"}], reports
    assert read_result(run_dir)["steps"] == 16
