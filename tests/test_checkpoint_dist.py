"""Checkpoints of real 2-process Gloo jobs: round trip, kill -9 mid-save, world-size changes."""

from __future__ import annotations

import os
import signal

import pytest
from ckpt_support import launch

from hpc_ddp.checkpoint import Checkpointer, CheckpointMismatchError
from hpc_ddp.localslurm import wait_for


class Logs(list):
    def __call__(self, line: str) -> None:
        self.append(line)

    def has(self, *words: str) -> bool:
        return any(all(w in line for w in words) for line in self)


def test_two_ranks_round_trip_prune_and_reload_on_other_world_sizes(tmp_path):
    root = tmp_path / "ckpt"
    ranks = launch(tmp_path, root, 2, "--steps", "10,20,30", "--load")
    assert ranks.wait() == [0, 0], ranks.logs()
    r0, r1 = ranks.result(0), ranks.result(1)
    final = [str(root / f"step-{s:08d}") for s in (10, 20, 30)]
    assert r0["saved"] == r1["saved"] == final  # the final path is returned on every rank
    for rank, res in enumerate((r0, r1)):
        loaded = res["loaded"]
        assert (loaded["step"], loaded["world_size"], loaded["per_rank_rank"]) == (30, 2, rank)
        assert loaded["fingerprint"] == loaded["expected_fingerprint"]
        assert loaded["keys"] == ["b", "w"]  # "module." stripped
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".run")) == [
        "latest",
        "step-00000020",
        "step-00000030",
    ]
    files = sorted(p.name for p in (root / "step-00000030").iterdir())
    assert files == ["manifest.json", "rank-00000.pt", "rank-00001.pt", "shared.pt"]

    # The same checkpoint seen by a smaller and a larger world.
    logs = Logs()
    one = Checkpointer(root, rank=0, world_size=1, log=logs).load_latest()
    assert one.world_size == 2 and one.per_rank["rank"] == 0
    assert logs.has("saved by 2 ranks", "has 1")
    with pytest.raises(CheckpointMismatchError, match="world size = 2, but this run expects 1"):
        Checkpointer(root, rank=0, world_size=1, log=logs).load_latest(expect={"world_size": 1})
    third = Checkpointer(root, rank=2, world_size=3, log=logs).load_latest()
    assert third.step == 30 and third.per_rank is None  # rank 2 did not exist when saved


@pytest.mark.parametrize(
    ("pause", "leftover"),
    [
        ("1:written", None),  # a non-zero rank dies after writing its file: rank 0 cleans up
        ("0:manifest", ".tmp-step-00000020"),  # rank 0 dies after the manifest, before rename
        ("0:renamed", "step-00000020"),  # rank 0 dies after the rename, before `latest`
    ],
)
def test_kill_9_mid_save_leaves_the_previous_checkpoint(tmp_path, pause, leftover):
    root = tmp_path / "ckpt"
    first = launch(tmp_path, root, 2, "--steps", "10", tag="first")
    assert first.wait() == [0, 0], first.logs()

    ranks = launch(tmp_path, root, 2, "--steps", "20", "--pause", pause, tag="crash")
    victim = int(pause.split(":")[0])
    flag = ranks.out / f"paused-{victim}"
    try:
        wait_for(flag.exists, 90, f"rank {victim} to pause at {pause}")
    finally:
        if not flag.exists():
            print(ranks.logs())
    os.kill(ranks.procs[victim].pid, signal.SIGKILL)
    codes = ranks.wait(timeout=90)  # the survivor must not hang in its agreement
    survivor = 1 - victim
    assert codes[victim] == -signal.SIGKILL
    assert codes[survivor] == 3, ranks.logs()
    err = ranks.result(survivor)["error"]
    assert err["type"] == "CheckpointWriteError" and "step 20" in err["message"], err

    # Exactly what the crash left: the previous checkpoint committed, the new one not.
    assert (root / "latest").read_text() == "step-00000010\n"
    left = sorted(p.name for p in root.iterdir() if not p.name.startswith((".run", "latest")))
    assert left == sorted(["step-00000010", *([leftover] if leftover else [])])
    logs = Logs()
    loaded = Checkpointer(root, rank=0, world_size=2, log=logs, agree=lambda ok: ok).load_latest()
    assert loaded.step == 10, logs
    if leftover is None:
        pass
    elif leftover.startswith(".tmp"):
        assert not (root / leftover).exists() and logs.has(leftover, "interrupted save")
    else:
        assert logs.has(leftover, "never committed")

    # The resumed job saves the same step again over whatever was left.
    again = launch(tmp_path, root, 2, "--steps", "20", "--load", tag="again")
    assert again.wait() == [0, 0], again.logs()
    assert again.result(1)["loaded"]["step"] == 20
    names = sorted(p.name for p in root.iterdir() if not p.name.startswith(".run"))
    assert names == ["latest", "step-00000010", "step-00000020"]


def test_ranks_fall_back_together_when_one_ranks_file_is_corrupt(tmp_path):
    """Each rank verifies only what it reads; the agreement makes the choice common."""
    root = tmp_path / "ckpt"
    first = launch(tmp_path, root, 2, "--steps", "10,20", tag="first")
    assert first.wait() == [0, 0], first.logs()
    path = root / "step-00000020" / "rank-00001.pt"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))

    ranks = launch(tmp_path, root, 2, "--load", tag="load")
    assert ranks.wait() == [0, 0], ranks.logs()
    assert [ranks.result(r)["loaded"]["step"] for r in (0, 1)] == [10, 10]
    assert "skipping step-00000020: rank(s) 1 could not verify" in ranks.logs()

    other = launch(tmp_path, root, 2, "--load", "--expect-model", "resnet50", tag="other")
    assert other.wait() == [3, 3], other.logs()
    for r in (0, 1):
        err = other.result(r)["error"]
        assert err["type"] == "CheckpointMismatchError", err
        assert "'toy'" in err["message"] and "'resnet50'" in err["message"]
