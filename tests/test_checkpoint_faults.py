"""Real I/O faults during a save: a full tmpfs (ENOSPC) and a file-size limit (EFBIG)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_support import launch

from hpc_ddp.checkpoint import Checkpointer, CheckpointWriteError


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs: writes past it fail with ENOSPC from the kernel."""
    mnt = tmp_path / f"tiny-{uuid.uuid4().hex[:8]}"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2M", "tmpfs", str(mnt)], capture_output=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def small(step: int) -> dict:
    return {"model": {"w": torch.full((16,), float(step))}}


def test_full_disk_fails_loudly_and_keeps_the_previous_checkpoint(full_disk):
    root = full_disk / "run"
    ck = Checkpointer(root, rank=0, world_size=1, log=lambda _: None)
    ck.save(10, shared=small(10), per_rank={}, meta={"epoch": 1})
    ballast = torch.zeros(1 << 20)  # 4 MiB of float32 on a 2 MiB file system
    with pytest.raises(CheckpointWriteError) as err:
        ck.save(20, shared=small(20), per_rank={"ballast": ballast}, meta={"epoch": 2})
    text = str(err.value)
    assert "ENOSPC" in text and str(root / ".tmp-step-00000020") in text, text
    assert "MiB free" in text and "free space" in err.value.hint, text
    assert (root / "latest").read_text() == "step-00000010\n"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000010"]  # no debris
    loaded = ck.load_latest()
    assert loaded.step == 10 and torch.equal(loaded.shared["model"]["w"], small(10)["model"]["w"])
    ck.save(30, shared=small(30), per_rank={}, meta={"epoch": 3})  # space came back: saving works
    assert ck.load_latest().step == 30


def test_full_disk_on_one_rank_makes_every_rank_raise(tmp_path, full_disk):
    root = full_disk / "run"
    first = launch(tmp_path, root, 2, "--steps", "10", tag="first")
    assert first.wait() == [0, 0], first.logs()
    # Rank 1 starts writing only after rank 0 has written its files: otherwise rank 1 may fill
    # the disk first and rank 0 fails on its own ENOSPC (also correct, but not this test).
    args = ["--steps", "20", "--big-rank", "1", "--big-mb", "4", "--rank0-writes-first"]
    ranks = launch(tmp_path, root, 2, *args)
    assert ranks.wait(timeout=90) == [3, 3], ranks.logs()
    e0, e1 = ranks.result(0)["error"], ranks.result(1)["error"]
    assert e1["type"] == "CheckpointWriteError" and "ENOSPC" in e1["message"], e1
    assert "rank-00001.pt" in e1["message"]
    assert e0["type"] == "CheckpointWriteError", e0
    assert "rank(s) 1 failed in the write phase" in e0["message"], e0
    assert (root / "latest").read_text() == "step-00000010\n"
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".run")) == [
        "latest",
        "step-00000010",
    ]


def test_file_size_limit_is_reported_with_the_path(tmp_path):
    """RLIMIT_FSIZE in a child process: the kernel refuses the write with EFBIG (Python ignores
    SIGXFSZ, so the write fails instead of killing the process)."""
    script = textwrap.dedent(
        f"""
        import resource, sys, torch
        from hpc_ddp.checkpoint import Checkpointer, CheckpointWriteError
        ck = Checkpointer({str(tmp_path / "run")!r}, rank=0, world_size=1, log=lambda _: None)
        ck.save(1, shared={{"model": {{"w": torch.zeros(4)}}}}, per_rank={{}}, meta={{}})
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            ck.save(2, shared={{"model": {{"w": torch.zeros(1 << 19)}}}}, per_rank={{}}, meta={{}})
        except CheckpointWriteError as exc:
            print(exc)
            print("latest:", ck.load_latest().step)
            sys.exit(0)
        sys.exit("no error raised")
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "EFBIG" in proc.stdout and "shared.pt" in proc.stdout, proc.stdout
    assert "latest: 1" in proc.stdout
