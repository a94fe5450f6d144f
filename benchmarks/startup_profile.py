"""Where the seconds before the first step go, one level below probe.py's phases.

    PYTHONPATH=$PWD python3 benchmarks/startup_profile.py --nproc 4 --out DIR

1. ``import torch`` in fresh interpreters (``--repeats``): wall time, and from ``-X importtime``
   the modules with the most self time (a module's self time includes the shared libraries its
   body loads: torch._C's is libtorch's, torch's own the CUDA libraries of _load_global_deps).
2. ``import torch`` and one CUDA context, in 1 and ``--nproc`` fresh interpreters side by side:
   one after the other (as torch does it), or the context made on a thread during the import
   through the driver API, from its start or once torch._C has loaded.
3. The process group: ``--nproc`` workers forked after ``import torch``, as hpc_ddp.spawn forks
   them. Each times its CUDA context, the TCPStore rendezvous, ``init_process_group`` and the
   first two all-reduces. Variants:
   - ``eager``: the trainer's way (``device_id`` given: NCCL's communicator is made in init);
   - ``lazy``: no ``device_id``, so the communicator is made by the first all-reduce;
   - ``overlap``: eager init on a thread while the main thread copies CIFAR-sized arrays
     (180 MB) to the GPU, which shows whether init lets go of the interpreter meanwhile;
   - ``solo``: one worker alone, for the CUDA context without the others starting beside it.
   NCCL's own ``Init timings`` lines (NCCL_DEBUG=INFO) are kept in the JSON.
Writes ``startup.json`` and prints a table. Needs CUDA GPUs and NCCL.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpc_ddp.cluster.master_port import free_port

VARIANTS = ("eager", "lazy", "overlap", "solo")
CIFAR_BYTES = 180 * 2**20  # train + test splits of CIFAR as uint8


def import_profile(repeats: int) -> dict[str, Any]:
    """Fresh interpreters importing torch: wall time of each, and the costliest modules by self
    time in the last one (the earlier ones warm the page cache)."""
    walls: list[float] = []
    rows: list[tuple[str, float, float, int]] = []
    for _ in range(repeats):
        t0 = time.time()
        proc = subprocess.run(
            [sys.executable, "-X", "importtime", "-c", "import torch"],
            capture_output=True,
            text=True,
            check=True,
        )
        walls.append(time.time() - t0)
        rows.clear()
        for line in proc.stderr.splitlines():
            match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
            if match:
                self_us, cum_us, indent, name = match.groups()
                rows.append((name, int(self_us) / 1e6, int(cum_us) / 1e6, len(indent) // 2))
    top = sorted(rows, key=lambda row: -row[1])[:25]
    return {
        "wall_s": walls,
        "python_only_s": _bare_interpreter_s(),
        "total_self_s": sum(row[1] for row in rows),
        "top_self_s": [{"module": n, "self_s": s, "cum_s": c} for n, s, c, _ in top],
        "top_level_cum_s": {n: c for n, _, c, depth in rows if depth == 0 and c > 0.01},
    }


def _bare_interpreter_s() -> float:
    t0 = time.time()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    return time.time() - t0


# One fresh interpreter: import torch while (or before) the CUDA context of one device is made
# through the driver API (its primary context, the one torch then uses); prints seconds as JSON.
# argv: when, device.
#   serial: the context after the import (what torch itself does)
#   start:  on a thread from the start of the import
#   after_c: on a thread once torch._C (the shared libraries) has loaded
OVERLAP_SNIPPET = """
import ctypes, json, sys, threading, time
t0 = time.time()
when, device = sys.argv[1], int(sys.argv[2])
done = {}
def make():
    a = time.time()
    libcuda = ctypes.CDLL('libcuda.so.1')
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert libcuda.cuInit(0) == 0 and libcuda.cuDeviceGet(ctypes.byref(dev), device) == 0
    assert libcuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    done.update(s=time.time() - a, end=time.time())
thread = threading.Thread(target=make)
class AfterC:
    def find_spec(self, name, *_):
        if 'torch._C' in sys.modules and not thread.is_alive() and not done:
            sys.meta_path.remove(self); thread.start()
if when == 'start':
    thread.start()
elif when == 'after_c':
    sys.meta_path.insert(0, AfterC())
import torch
t1 = time.time()
if when == 'serial':
    thread.start()
thread.join()
torch.ones(1, device=f'cuda:{device}')  # torch adopts the primary context
ready = max(t1, done['end']) - t0
print(json.dumps({'import_s': t1 - t0, 'context_s': done['s'], 'ready_s': ready}))
"""


def overlap_profile(repeats: int, nproc: int) -> dict[str, Any]:
    """``import torch`` and one CUDA context, in 1 and ``nproc`` interpreters side by side:
    after each other, overlapped from the start, overlapped after torch._C; the order of the
    variants rotates between repeats."""
    whens = ["serial", "start", "after_c"]
    out: dict[str, list[dict[str, Any]]] = {}
    for i in range(repeats):
        for when in whens[i % 3 :] + whens[: i % 3]:
            for procs in sorted({1, nproc}):
                cmd = [sys.executable, "-c", OVERLAP_SNIPPET, when]
                running = [
                    subprocess.Popen([*cmd, str(d)], stdout=subprocess.PIPE, text=True)
                    for d in range(procs)
                ]
                rows = [json.loads(p.communicate()[0]) for p in running]
                out.setdefault(f"{when}_x{procs}", []).append(
                    {key: max(r[key] for r in rows) for key in rows[0]}
                )
    return out


def worker(variant: str, rank: int, world: int, port: int, result_path: Path) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    marks: dict[str, float] = {"start": time.time()}
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)
    torch.cuda.synchronize()
    marks["cuda_context"] = time.time()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, wait_for_workers=False)
    marks["store"] = time.time()

    def init() -> None:
        torch.cuda.set_device(device)  # the current device is per thread
        kwargs = {} if variant == "lazy" else {"device_id": device}
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, **kwargs)
        marks["init_process_group"] = time.time()

    if variant == "overlap":
        thread = threading.Thread(target=init)
        thread.start()
        host = np.ones(CIFAR_BYTES, dtype=np.uint8)
        torch.from_numpy(host).to(device)
        torch.cuda.synchronize()
        marks["copy_done"] = time.time()
        thread.join()
    else:
        init()
    ones = torch.ones(1, device=device)
    for name in ("first_allreduce", "second_allreduce"):
        dist.all_reduce(ones)
        torch.cuda.synchronize()
        marks[name] = time.time()
    dist.destroy_process_group()
    result_path.write_text(json.dumps(marks))


def run_variant(variant: str, nproc: int, port: int, out: Path) -> dict[str, Any]:
    world = 1 if variant == "solo" else nproc
    log_dir = out / f"nccl_{variant}"
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.update(
        NCCL_DEBUG="INFO",
        NCCL_DEBUG_SUBSYS="INIT",
        NCCL_DEBUG_FILE=str(log_dir / "%h.%p.log"),
    )
    t_fork = time.time()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                worker(variant, rank, world, port, out / f"{variant}_{rank}.json")
            except BaseException as err:  # the parent reports the exit code
                print(f"[{variant} rank {rank}] {err!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    ranks = []
    for rank in range(world):
        path = out / f"{variant}_{rank}.json"
        if path.exists():
            marks = json.loads(path.read_text())
            ranks.append(_durations(marks, t_fork))
    timings = []
    for log in sorted(log_dir.glob("*.log")):
        timings += [line.strip() for line in log.read_text().splitlines() if "timings" in line]
    return {"exit_codes": codes, "ranks": ranks, "nccl_init_timings": timings}


def _durations(marks: dict[str, float], t_fork: float) -> dict[str, float]:
    order = sorted(marks.items(), key=lambda item: item[1])
    steps = {"fork_to_start": order[0][1] - t_fork}
    previous = order[0][1]
    for name, when in order[1:]:
        steps[name] = when - previous
        previous = when
    steps["total"] = order[-1][1] - t_fork
    return steps


def print_table(report: dict[str, Any]) -> None:
    imports = report["imports"]
    walls = ", ".join(f"{w:.2f}" for w in imports["wall_s"])
    bare = imports["python_only_s"]
    print(f"import torch, fresh interpreters: {walls} s (bare python {bare:.2f} s)")
    for row in imports["top_self_s"][:12]:
        print(f"  {row['module']:<50} self {row['self_s']:.3f} s   cum {row['cum_s']:.3f} s")
    print("import torch and one CUDA context (slowest interpreter; mean of repeats):")
    for name, rows in report["overlap"].items():
        cells = "  ".join(f"{k} {sum(r[k] for r in rows) / len(rows):.2f}" for k in rows[0])
        print(f"  {name:<12} {cells}")
    for variant, res in report["process_group"].items():
        print(f"{variant}: exit codes {res['exit_codes']}")
        for rank, steps in enumerate(res["ranks"]):
            cells = "  ".join(f"{k} {v:.3f}" for k, v in steps.items())
            print(f"  rank {rank}: {cells}")
        for line in res["nccl_init_timings"][:4]:
            print(f"  NCCL: {line[-160:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="fresh interpreters importing torch")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"imports": import_profile(args.repeats), "process_group": {}}
    save = out / "startup.json"
    save.write_text(json.dumps(report, indent=1))  # after each part: a later failure keeps it
    report["overlap"] = overlap_profile(args.repeats, args.nproc)
    save.write_text(json.dumps(report, indent=1))
    import torch  # after the subprocesses above, before the forks below (never CUDA here)

    report["torch"] = torch.__version__
    for variant in (v for v in args.variants.split(",") if v):
        report["process_group"][variant] = run_variant(variant, args.nproc, free_port(), out)
        save.write_text(json.dumps(report, indent=1))
    print_table(report)


if __name__ == "__main__":
    main()
