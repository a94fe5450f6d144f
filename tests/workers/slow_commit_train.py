"""``python -m hpc_ddp.train`` on a slow file system: each checkpoint commit takes a second.

For tests/test_checkpoint_async.py: with background saves (the default), the run must not report
success (result.json) or a preemption (the requeue, exit 75) before its last checkpoint is
committed. Two wrappers, applied before ``--nproc-per-node`` forks the workers:

- ``committed.write_latest`` (the commit point, on the saving thread) waits ``COMMIT_DELAY_S``
  first: a slow ``latest`` rename, not a wait for anything in the test;
- at the two reporting points (``results.write_json`` of result.json, the requeue that the
  trainer's ``Resumable.requeue`` asks for: ``hpc_ddp.runtime.resumable.requeue``) the
  worker appends what ``checkpoints/latest`` names at that moment to ``<run-dir>/reports.jsonl``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from hpc_ddp.checkpoint import committed
from hpc_ddp.run_dir import paths as run_dir_paths
from hpc_ddp.runtime import resumable
from hpc_ddp.train import cli as command
from hpc_ddp.train import results

COMMIT_DELAY_S = 1.0


def record(run_dir: Path, event: str) -> None:
    latest = run_dir / "checkpoints" / "latest"
    named = latest.read_text().strip() if latest.exists() else None
    with open(run_dir / "reports.jsonl", "a") as fh:
        fh.write(json.dumps({"event": event, "latest": named}) + "\n")


write_latest, write_json, requeue = committed.write_latest, results.write_json, resumable.requeue


def slow_write_latest(root: Path, name: str) -> None:
    time.sleep(COMMIT_DELAY_S)  # the slow file system this worker simulates
    write_latest(root, name)


def recording_write_json(path: Path, data: Any) -> None:
    if path.name == run_dir_paths.RESULT:
        record(path.parent, "result")
    write_json(path, data)


def recording_requeue(mode: str, *args: Any, **kwargs: Any) -> str:
    record(Path(sys.argv[sys.argv.index("--run-dir") + 1]), "requeue")
    return requeue(mode, *args, **kwargs)


committed.write_latest = slow_write_latest
results.write_json = recording_write_json
resumable.requeue = recording_requeue

if __name__ == "__main__":
    command.main(sys.argv[1:])
