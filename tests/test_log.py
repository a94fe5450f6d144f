"""hpc_ddp.log: rank 0's records are the log; other ranks' warnings and errors still reach it.

Each case runs in a fresh interpreter with the rank a launcher sets (RANK), as a worker has it.
"""

from __future__ import annotations

import subprocess
import sys

CODE = """
from hpc_ddp.log import get_logger
log = get_logger("train")
log.info("progress line")
log.warning("disk nearly full")
log.error("save failed")
"""


def _run(rank: str) -> subprocess.CompletedProcess[str]:
    env = {"RANK": rank, "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=60
    )


def test_rank_zero_logs_every_record_with_its_text_unchanged() -> None:
    out = _run("0")
    assert out.stdout.splitlines() == ["progress line", "disk nearly full", "save failed"]


def test_other_ranks_log_only_warnings_and_errors_marked_with_their_rank() -> None:
    out = _run("3")
    assert out.stdout.splitlines() == ["[rank 3] disk nearly full", "[rank 3] save failed"]


def test_the_checkpointer_logs_through_it_unless_given_a_callback(tmp_path) -> None:
    code = f"""
from hpc_ddp.checkpoint import Checkpointer
ck = Checkpointer({str(tmp_path)!r}, rank=0, world_size=1)
ck.save(1, shared={{"w": 1}}, per_rank={{}}, meta={{}})
"""
    env = {"RANK": "0", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("checkpoint: saved "), out.stdout
