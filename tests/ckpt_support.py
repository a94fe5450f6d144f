"""Helpers for the checkpoint tests: launch real Gloo ranks, wait on conditions with deadlines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from cli_forkserver import ForkedProcess
from trainer_helpers import fork_server

WORKER = Path(__file__).parent / "workers" / "ckpt_worker.py"


@dataclass
class Ranks:
    procs: list[ForkedProcess]
    out: Path

    def wait(self, timeout: float = 120) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                self.kill()
                msg = f"ranks still running after {timeout} s:\n{self.logs()}"
                raise AssertionError(msg) from None
        return codes

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()

    def result(self, rank: int) -> dict:
        return json.loads((self.out / f"result-{rank}.json").read_text())

    def logs(self) -> str:
        return "\n".join(
            f"--- rank {r} ---\n{(self.out / f'log-{r}.txt').read_text()}"
            for r in range(len(self.procs))
        )


def launch(tmp: Path, root: Path, world_size: int, *args: str, tag: str = "run") -> Ranks:
    """Start ``world_size`` worker processes that form one Gloo group through a FileStore, each
    forked from the tests' fork server (trainer_helpers.fork_server), which imported torch."""
    out = tmp / tag
    out.mkdir()
    store = out / "store"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    procs = []
    for r in range(world_size):
        argv = [str(WORKER), "--root", str(root), "--out", str(out)]
        argv += ["--store", str(store), "--rank", str(r), "--world-size", str(world_size), *args]
        procs.append(fork_server().start(argv, out / f"log-{r}.txt", env=env, script=True))
    return Ranks(procs, out)


class Counter:
    """A loop's own extra state: any object with ``state_dict``/``load_state_dict``."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]
