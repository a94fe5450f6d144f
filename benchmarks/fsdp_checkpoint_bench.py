"""Checkpoint stall of an FSDP2 model: sync and async sharded saves (DCP) against torch.save of the
gathered state, and the resume time (command to first step after a requeue).

    PYTHONPATH=$PWD python3 benchmarks/fsdp_checkpoint_bench.py --gpus 2 --dir /tmp/fsdp-bench
    PYTHONPATH=$PWD python3 benchmarks/fsdp_checkpoint_bench.py --tiny     # CPU/Gloo plumbing check

The driver (this process, no torch.distributed) starts the ranks with torchrun twice: a training
phase that measures every kind of save, then, as a requeued job would, a fresh launch that
restores the newest checkpoint and takes one step; the resume time runs from that command to the
end of its first step. The model is a stack of ``--layers`` Linear(``--width``, ``--width``)
layers (the default: 60 x 4096^2, 1.01 B parameters), each ``fully_shard``-ed with bf16 mixed
precision on GPU, AdamW: per save the state is 4 bytes of weights + 8 of Adam moments per
parameter (12 GB at 1 B parameters, half per rank on 2 GPUs).

Per kind of save, three numbers per save, ``--repeats`` saves of each kind (``--async-repeats``
of the async sharded one: its first save also pins the host memory later saves reuse):

* ``call``: how long the save call kept the training thread (sync: the whole save; async: the
  queued copy, plus waiting for the previous save, which has always ended here);
* ``stall``: the wall-clock time of the save call and the steps after it until the save is
  committed (at least ``--window``), minus as many steps of the clean baseline: what training
  lost, the background thread's share included;
* ``done``: from the call until the checkpoint is committed (async: in the background).

Prints a markdown table; ``--json`` writes the numbers too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = {
    "layers": 4, "width": 64, "batch": 4, "repeats": 2, "async_repeats": 2, "window": 3,
    "baseline": 5,
}  # fmt: skip
MAX_STEPS_PER_SAVE = 10_000


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=2, help="ranks (GPUs; CPU processes with --tiny)")
    p.add_argument("--dir", type=Path, default=None, help="checkpoint dir (default: a tmp dir)")
    p.add_argument("--layers", type=int, default=60)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--batch", type=int, default=8, help="rows per rank and step")
    p.add_argument("--repeats", type=int, default=1, help="saves of each kind")
    p.add_argument("--async-repeats", type=int, default=3, help="async saves (first pins memory)")
    p.add_argument(
        "--window", type=int, default=10, help="steps after a save counted in stall, at least"
    )
    p.add_argument("--baseline", type=int, default=20, help="clean steps timed for the baseline")
    p.add_argument("--tiny", action="store_true", help="a tiny model on CPU (Gloo): a test run")
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    p.add_argument("--phase", choices=["train", "resume"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.tiny:
        for key, value in TINY.items():
            setattr(a, key, value)
    for name in (
        "gpus",
        "layers",
        "width",
        "batch",
        "repeats",
        "async_repeats",
        "window",
        "baseline",
    ):
        if not 1 <= getattr(a, name) <= 1_000_000:
            p.error(f"--{name} must be between 1 and 1000000")
    return a


# ------------------------------------------------------------------------------------ the ranks
def build(a: argparse.Namespace, cuda: bool):
    import torch
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(a.width, a.width) for _ in range(a.layers)])
    kwargs = {}
    if cuda:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    for layer in model:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device="cuda" if cuda else "cpu")
    with torch.no_grad():  # each rank fills its own shards: no DTensor random-op machinery
        for p in model.parameters():
            p.to_local().normal_(0.0, a.width**-0.5)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5)


def rank_main(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from hpc_ddp.checkpoint import Checkpointer
    from hpc_ddp.runtime.sharded_state import ShardedState

    cuda = not a.tiny and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    model, opt = build(a, cuda)
    state = ShardedState({"model": model, "optimizer": opt})
    ck = Checkpointer(
        a.dir / "run" / "checkpoints",
        rank=rank,
        world_size=world,
        keep=2,
        async_save=True,
        sharded=True,
        log=lambda _line: None,
    )
    x = torch.randn(a.batch, a.width, device=device)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step() -> None:
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def steps(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            train_step()
        sync()
        return time.perf_counter() - t0

    if a.phase == "resume":
        t0 = time.perf_counter()
        into = state.state_dict()
        loaded = ck.load_latest(sharded_into=into)
        assert loaded is not None, "no checkpoint to resume from"
        state.load_state_dict(into)
        sync()
        load_s = time.perf_counter() - t0
        train_step()
        sync()
        dist.barrier()
        if rank == 0:
            a.result.write_text(json.dumps({"first_step_unix": time.time(), "load_s": load_s}))
        dist.destroy_process_group()
        return

    steps(3)  # warm-up: kernels, allocator, optimizer state
    base = statistics.median(steps(1) for _ in range(a.baseline))
    results: dict[str, dict[str, list[float]]] = {}
    step_no = iter(range(1, 1_000_000))
    gloo = dist.new_group(backend="gloo")

    def measure(kind: str, start, pending, finish, repeats: int) -> None:
        for _ in range(repeats):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            handle = start()
            call = time.perf_counter() - t0
            done = call if not pending(handle) else None
            # Train on until the save is committed (at least --window steps): the stall counts
            # every step the background work slowed, not only the first few.
            n = 0
            while n < a.window or (done is None and n < MAX_STEPS_PER_SAVE):
                train_step()
                n += 1
                if done is None and not pending(handle):  # committed by now (one step's grain)
                    done = time.perf_counter() - t0
            sync()
            stall = time.perf_counter() - t0 - n * base
            finish(handle)
            if done is None:
                done = time.perf_counter() - t0
            row = results.setdefault(kind, {"call": [], "stall": [], "done": []})
            row["call"].append(call)
            row["stall"].append(stall)
            row["done"].append(done)
            if rank == 0:  # as it lands: a run cut short still says what it measured
                print(f"{kind}: call {call:.3f} s, stall {stall:.3f} s, done {done:.3f} s, "
                      f"{n} steps", flush=True)  # fmt: skip

    def sharded_sync():
        sync()
        return ck.save(next(step_no), shared=state.state_dict(), per_rank={}, meta={})

    def sharded_async():
        return ck.save_async(next(step_no), shared=state.state_dict(), per_rank={}, meta={})

    def gathered():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(model, opt, options=options)
        if rank == 0:
            torch.save({"model": msd, "optimizer": osd}, a.dir / "full.pt")
        return None

    def raw_async():
        import torch.distributed.checkpoint as dcp

        target = a.dir / f"raw-{next(step_no)}"
        return target, dcp.async_save(state.state_dict(), checkpoint_id=target, process_group=gloo)

    def raw_done(handle) -> None:
        target, future = handle
        future.result()
        dist.barrier()
        if rank == 0:  # the disk holds one of these at a time
            shutil.rmtree(target)

    never = lambda _h: False  # noqa: E731 (a synchronous save is done when its call returns)
    in_flight = lambda _h: ck.in_flight  # noqa: E731
    raw_pending = lambda h: not h[1].done()  # noqa: E731
    raw = "bare dcp.async_save (no manifest, no hash)"
    try:
        measure(raw, raw_async, raw_pending, raw_done, a.repeats)
    except Exception as exc:  # a torch without a thread-based async_save: the row says why
        results[raw] = {"error": [str(exc)[:120]]}
    measure(
        "torch.save of the gathered state (rank 0)",
        gathered,
        never,
        lambda _h: dist.barrier(),
        a.repeats,
    )
    measure("sharded, sync (Checkpointer.save)", sharded_sync, never, lambda _h: None, a.repeats)
    # Last: its newest save is the checkpoint the resume phase loads.
    # Repeated: the first save also pins its host memory, which later saves reuse.
    measure(
        "sharded, async (Checkpointer.save_async)",
        sharded_async,
        in_flight,
        lambda _h: ck.wait(),
        a.async_repeats,
    )
    ck.close()
    if rank == 0:
        nparams = sum(p.numel() for p in model.parameters())
        per_rank = sum(
            t.to_local().numel() * t.to_local().element_size() for t in _tensors(state.state_dict())
        )
        out = {"params": nparams, "bytes_per_rank": per_rank, "step_s": base, "rows": results}
        out.update(world=world, device=torch.cuda.get_device_name() if cuda else "cpu")
        a.result.write_text(json.dumps(out))
    dist.destroy_process_group()


def _tensors(obj):
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)


# ----------------------------------------------------------------------------------- the driver
def torchrun(a: argparse.Namespace, phase: str, result: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={a.gpus}", __file__, "--phase", phase, "--result", str(result)]
    cmd += ["--dir", str(a.dir), "--layers", str(a.layers), "--width", str(a.width)]
    cmd += ["--batch", str(a.batch), "--repeats", str(a.repeats), "--window", str(a.window)]
    cmd += ["--async-repeats", str(a.async_repeats)]
    cmd += ["--baseline", str(a.baseline)] + (["--tiny"] if a.tiny else [])
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    done = subprocess.run(cmd, env=env, text=True, timeout=900, check=False)  # output as it comes
    if done.returncode != 0:
        sys.exit(f"{phase} phase failed ({done.returncode}): its output is above")
    return done


def table(train: dict, resume: dict, resume_s: float) -> str:
    gb = train["bytes_per_rank"] * train["world"] / 1e9
    lines = [
        f"FSDP2, {train['params'] / 1e9:.2f} B parameters, {train['world']} x {train['device']}, "
        f"{gb:.1f} GB per checkpoint ({gb / train['world']:.1f} GB per rank), "
        f"step {train['step_s'] * 1e3:.1f} ms",
        "",
        "Each save of a kind, in order (`a / b / c`). Stall: the wall-clock time from the save "
        "call until it is committed (at least the next steps), minus as many clean steps.",
        "",
        "| save | training thread blocked, s | stall (wall clock), s | until committed, s |",
        "|---|---|---|---|",
    ]
    for kind, row in train["rows"].items():
        if "error" in row:
            lines.append(f"| {kind} | failed: {row['error'][0]} | | |")
            continue
        shown = {k: " / ".join(f"{x:.3f}" for x in v) for k, v in row.items()}
        lines.append(f"| {kind} | {shown['call']} | {shown['stall']} | {shown['done']} |")
    lines += [
        "",
        "| resume after a requeue | s |",
        "|---|---|",
        f"| command to first step (torchrun, imports, build, load, one step) | {resume_s:.2f} |",
        f"| of which the checkpoint load (verify + DCP read, rank 0) | {resume['load_s']:.2f} |",
    ]
    return "\n".join(lines)


def main() -> None:
    a = parse()
    if a.phase is not None:
        rank_main(a)
        return
    if a.dir is not None:
        a.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="fsdp-bench-", dir=a.dir) as tmp:
        a.dir = Path(tmp)
        torchrun(a, "train", a.dir / "train.json")
        train = json.loads((a.dir / "train.json").read_text())
        t0 = time.time()
        torchrun(a, "resume", a.dir / "resume.json")
        resume = json.loads((a.dir / "resume.json").read_text())
        resume_s = resume["first_step_unix"] - t0
    print(table(train, resume, resume_s))
    if a.json:
        a.json.write_text(json.dumps({"train": train, "resume": resume, "resume_s": resume_s}))


if __name__ == "__main__":
    main()
