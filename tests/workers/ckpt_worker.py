"""One rank of a real multi-process Gloo job that saves and loads checkpoints (for the tests).

Run one process per rank; they meet through a FileStore (no ports). Writes
``<out>/result-<rank>.json`` with what it saved, loaded, or which error it raised, then exits
through hpc_ddp.dist.shutdown_and_exit (the Gloo exit-abort workaround).

--pause RANK:PHASE makes that rank, on reaching PHASE of the *last* save, create
``<out>/paused-<rank>`` and block until the test kills it with SIGKILL.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from hpc_ddp.checkpoint import Checkpointer
from hpc_ddp.dist import shutdown_and_exit
from hpc_ddp.train.fingerprint import params_sha256


def model_state(step: int) -> dict[str, torch.Tensor]:
    """A deterministic 'model' per step, with DDP's prefix to check that it is stripped."""
    g = torch.Generator().manual_seed(step)
    return {"module.w": torch.randn(64, 32, generator=g), "module.b": torch.randn(32, generator=g)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--steps", default="", help="comma-separated steps to save")
    p.add_argument("--load", action="store_true", help="load_latest after saving")
    p.add_argument("--pause", default="", help="RANK:PHASE to stop at in the last save")
    p.add_argument("--big-rank", type=int, default=-1, help="this rank saves --big-mb extra")
    p.add_argument("--big-mb", type=int, default=0)
    p.add_argument("--expect-model", default="")
    p.add_argument("--shared-mb", type=int, default=0, help="add this much to the model")
    p.add_argument(
        "--rank0-writes-first",
        action="store_true",
        help="other ranks start writing only once rank 0 has written (deterministic full disk)",
    )
    a = p.parse_args()

    dist.init_process_group(
        "gloo",
        init_method=f"file://{a.store}",
        rank=a.rank,
        world_size=a.world_size,
        timeout=timedelta(seconds=60),
    )
    steps = [int(s) for s in a.steps.split(",") if s]
    pause_rank, _, pause_phase = a.pause.partition(":")
    armed = {"on": False}

    def on_phase(phase: str) -> None:
        if a.rank0_writes_first and armed["on"]:
            flag = a.out / "rank0-written"
            if a.rank == 0 and phase == "written":
                flag.write_text("")
            elif a.rank > 0 and phase == "writing":
                deadline = time.monotonic() + 60
                while not flag.exists():  # rank 0 is writing; bounded by the deadline
                    if time.monotonic() > deadline:
                        raise TimeoutError("rank 0 did not finish writing within 60 s")
                    time.sleep(0.01)
        if armed["on"] and a.pause and int(pause_rank) == a.rank and phase == pause_phase:
            (a.out / f"paused-{a.rank}").write_text(phase)
            threading.Event().wait()  # until SIGKILL: the test waits for the file, then kills

    ck = Checkpointer(
        a.root, rank=a.rank, world_size=a.world_size, keep=2, on_phase=on_phase, log=print
    )
    result: dict = {"rank": a.rank, "saved": [], "error": None, "loaded": None}
    code = 0
    try:
        for i, step in enumerate(steps):
            armed["on"] = i == len(steps) - 1
            per_rank = {"rank": a.rank, "rng": torch.get_rng_state()}
            if a.rank == a.big_rank:
                per_rank["ballast"] = torch.zeros(a.big_mb << 18)  # float32: 4 bytes each
            shared = {"model": model_state(step), "progress": {"step": step}}
            if a.shared_mb:
                shared["model"]["module.big"] = torch.zeros(a.shared_mb << 18)
            t0 = time.perf_counter()
            path = ck.save(
                step,
                shared=shared,
                per_rank=per_rank,
                meta={"epoch": step // 10, "model": "toy"},
            )
            result["saved"].append(str(path))
            result.setdefault("save_s", []).append(time.perf_counter() - t0)
        if a.load:
            expect = {"model": a.expect_model} if a.expect_model else None
            loaded = ck.load_latest(expect=expect)
            if loaded is not None:
                result["loaded"] = {
                    "step": loaded.step,
                    "world_size": loaded.world_size,
                    "per_rank_rank": None if loaded.per_rank is None else loaded.per_rank["rank"],
                    "fingerprint": params_sha256(loaded.shared["model"]),
                    "expected_fingerprint": params_sha256(model_state(loaded.step)),
                    "keys": sorted(loaded.shared["model"]),
                }
    except Exception as exc:
        traceback.print_exc()
        result["error"] = {"type": type(exc).__name__, "message": str(exc)}
        code = 3
    (a.out / f"result-{a.rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    shutdown_and_exit(code)


if __name__ == "__main__":
    main()
