"""Markdown tables from bench.json (``python3 benchmarks/report.py bench.json``)."""

from __future__ import annotations

import json
import sys
from statistics import mean, median
from typing import Any

RESNET18_CIFAR100_PARAMS = 11_220_132  # fp32 gradients all-reduced per step


def _f(x: Any, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def steady_rate(run: dict) -> float | None:
    """Median samples/s of the epochs after the first (which pays for cuDNN autotuning and
    capture): one slow epoch (a clock dip, a neighbour) must not set the figure."""
    hist = run.get("history") or []
    rows = hist[1:] or hist
    return median(r["samples_per_second"] for r in rows) if rows else None


def _saves_s(run: dict) -> float | None:
    saves = run.get("saves")
    return sum(x.get("total", 0.0) for x in saves) if saves is not None else None


def _ok(run: dict | None) -> bool:
    return bool(run) and run.get("rc") == 0


def _ours_row(label: str, run: dict, base: dict | None = None) -> str:
    if not _ok(run):
        return f"| {label} | {run.get('gpus')} | {_why(run)} | | | | |"
    if not _ok(base):
        base = None
    acc = (run.get("result") or {}).get("test_accuracy")
    train, saves = run.get("train_s"), _saves_s(run)
    no_ckpt = train - saves if train is not None and saves is not None else None
    speed = ""
    if base is not None:
        speed = (
            f"{_f(_ratio(base.get('train_time_s'), train), '.1f')}x "
            f"({_f(_ratio(base.get('train_time_s'), no_ckpt), '.1f')}x) | "
            f"{_f(_ratio(base.get('wall_s'), run.get('wall_s')), '.1f')}x"
        )
    else:
        speed = " | "
    return (
        f"| {label} | {run.get('gpus')} | {_f(train)} ({_f(no_ckpt)}) | "
        f"{_f(run.get('wall_s'))} | {_f(acc, '.4f')} | {speed} |"
    )


def _why(run: dict) -> str:
    if run.get("skipped"):
        return "not run (time budget)"
    return "timed out" if run.get("rc") == "timeout" else f"failed (rc={run.get('rc')})"


def _base_row(label: str, r: dict, n: Any, *, plain_columns: bool = False) -> str:
    """The conventional script's row; ``plain_columns``: with the plain table's per-epoch and
    outside-train() columns, which that script's output does not have."""
    split = " - |" if plain_columns else ""
    if not _ok(r):
        return f"| {label} | {n} | {_why(r) if r else 'not run'} |{split} |{split} | | |"
    return (
        f"| {label} | {n} | {_f(r.get('train_time_s'))} |{split} {_f(r.get('wall_s'))} |{split} "
        f"{_f(r.get('test_accuracy'), '.4f')} | 1 | 1 |"
    )


def table_ref(runs: dict, gpus: list[int]) -> list[str]:
    out = ["### a. Reference workload (CIFAR-100 LeNet, 10 epochs, batch 64/GPU, Adam 1e-3)", ""]
    out += [
        "Training s: first step to the end of the last epoch (evaluation each epoch included); "
        "for hpc-ddp, in brackets, without its per-epoch checkpoint saves (the conventional "
        "script saves none). Speed-ups against the conventional DDP script on as many GPUs. "
        "hpc-ddp's workers are forked by `--nproc-per-node` unless the row says torchrun.",
        "",
        "| run | GPUs | training s | command-to-exit s | test acc | train speed-up | "
        "exit speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted(gpus, reverse=True):
        base = runs.get(f"ref_ddp_{n}gpu", {})
        out.append(_base_row("conventional DDP script", base, n))
        out.append(
            _ours_row("hpc-ddp train --cuda-graphs", runs.get(f"ours_lenet_{n}gpu", {}), base)
        )
    for name, label in (
        ("default", "hpc-ddp train, default flags (captured step, background checkpoints)"),
        ("async", "hpc-ddp train --cuda-graphs --async-checkpoint"),
        ("eager", "hpc-ddp train (eager DDP, no graphs)"),
        ("torchrun", "hpc-ddp train --cuda-graphs, one interpreter per worker (torchrun)"),
        ("again", "hpc-ddp train --cuda-graphs (again)"),
        ("first_read", "hpc-ddp train --cuda-graphs, first read of the files (writes the cache)"),
        ("split", "hpc-ddp train --cuda-graphs, all-reduce outside the graph"),
        ("noprogress", "hpc-ddp train --cuda-graphs, no per-step progress.json (probe)"),
    ):
        for key, run in runs.items():
            if key.startswith("ours_lenet_") and key.endswith(name):
                base = runs.get(f"ref_ddp_{run.get('gpus')}gpu", {})
                out.append(_ours_row(label, run, base))
    for key, run in runs.items():
        if key.startswith("ttfs_lenet_"):  # bench.py's ttfs suite: the headline run again
            base = runs.get(f"ref_ddp_{run.get('gpus')}gpu", {})
            variant = key.split("gpu_async", 1)[-1].lstrip("_")  # r1, backoff_r1, ...
            label = f"hpc-ddp train, default flags ({variant})"
            out.append(_ours_row(label, run, base))
    for key, r in runs.items():
        if key == "ref_single_1gpu":
            out.append(_base_row(f"conventional, 1 GPU no DDP (batch {r.get('batch_size')})", r, 1))
        if key.startswith("ref_dp_"):
            out.append(
                _base_row(
                    f"conventional DataParallel (batch {r.get('batch_size')})", r, r.get("gpus")
                )
            )
    return out


def table_scaling(runs: dict, gpus: list[int]) -> list[str]:
    out = ["", "### b. ResNet-18 weak scaling (bf16, batch 256/GPU, GPU-resident data)", ""]
    out += ["| step | GPUs | samples/s | per GPU | efficiency |", "|---|---|---|---|---|"]
    for suffix, label in (("", "eager DDP"), ("_graphs", "--cuda-graphs")):
        base = steady_rate(runs.get(f"resnet_1gpu{suffix}", {}))
        for n in gpus:
            rate = steady_rate(runs.get(f"resnet_{n}gpu{suffix}", {}))
            if rate is None and not base:
                continue
            eff = rate / (n * base) if rate and base else None
            out.append(
                f"| {label} | {n} | {_f(rate, '.0f')} | {_f(rate and rate / n, '.0f')} | "
                f"{_f(eff and 100 * eff, '.1f')}% |"
            )
    base = steady_rate(runs.get("resnet_1gpu", {}))
    bare = steady_rate(runs.get("resnet_1gpu_noddp", {}))
    if bare and base:
        out += [
            "",
            f"DDP wrapper cost at 1 GPU: {bare:.0f} samples/s bare vs {base:.0f} with "
            f"DDP: {100 * (bare / base - 1):.1f}%",
        ]
        for key, label in (
            ("ddpdefaults", "DDP with torch's defaults, not trainer.ddp_options"),
            ("stockopt", "DDP with torch.optim's own SGD class"),
            ("timed", "DDP with the all-reduce timing hook (--time-allreduce)"),
        ):
            rate = steady_rate(runs.get(f"resnet_1gpu_{key}", {}))
            if rate:
                out.append(f"({label}: {rate:.0f} samples/s, {100 * (bare / rate - 1):.1f}%)")
    return out


def table_weak(runs: dict) -> list[str]:
    """Weak scaling over repeated runs (bench.py's weak suite): each run's steady rate, the
    efficiency of the median N-GPU rate against N x the median 1-GPU rate, and its spread
    (the worst and best pairing of runs)."""
    rates: dict[int, list[float]] = {}
    for key, run in runs.items():
        if key.startswith("weak_") and _ok(run):
            rate = steady_rate(run)
            if rate:
                rates.setdefault(int(key.split("_")[1].removesuffix("gpu")), []).append(rate)
    if 1 not in rates or len(rates) < 2:
        return []
    out = ["", "### b2. ResNet-18 weak scaling, default flags, repeated runs", ""]
    out += ["| GPUs | runs | samples/s each | median | efficiency (median) | spread |"]
    out += ["|---|---|---|---|---|---|"]
    one = median(rates[1])
    for n in sorted(rates):
        each = ", ".join(f"{r:.0f}" for r in rates[n])
        eff = median(rates[n]) / (n * one)
        lo, hi = min(rates[n]) / (n * max(rates[1])), max(rates[n]) / (n * min(rates[1]))
        out.append(
            f"| {n} | {len(rates[n])} | {each} | {median(rates[n]):.0f} | {100 * eff:.1f}% | "
            f"{100 * lo:.1f}-{100 * hi:.1f}% |"
        )
    return out


def stall_split(run: dict) -> dict[str, list[float]] | None:
    """A stall-suite run's epoch wall times (end of one epoch's save to the end of the next's),
    epoch 1 left out: "saving" epochs end with a save, "after" ones follow a saving one (its
    background write runs beside them), "clean" ones neither."""
    ends, saved = run.get("epoch_ends") or [], {s["epoch"] for s in run.get("saves") or []}
    split: dict[str, list[float]] = {"saving": [], "after": [], "clean": []}
    for epoch in range(2, len(ends) + 1):  # 1-based; ends[e - 1] is epoch e's end
        wall = ends[epoch - 1] - ends[epoch - 2]
        kind = "saving" if epoch in saved else "after" if epoch - 1 in saved else "clean"
        split[kind].append(wall)
    return split if all(split.values()) else None


def table_stall(runs: dict) -> list[str]:
    """A checkpoint's cost on the wall clock (bench.py's stall suite): per save, the median
    saving epoch plus the median epoch after it, less two median clean epochs of the run."""
    rows = []
    for key, run in runs.items():
        split = stall_split(run) if key.startswith("stall_") and _ok(run) else None
        if split is None:
            continue
        clean, saving, after = (median(split[k]) for k in ("clean", "saving", "after"))
        stall = saving + after - 2 * clean
        host = [s.get("total", 0.0) for s in run.get("saves") or []]
        staged = run.get("stages") or [0.0]
        rows.append(
            f"| {key} | {len(split['saving'])} / {len(split['clean'])} | {1e3 * clean:.1f} | "
            f"{1e3 * (saving - clean):+.1f} | {1e3 * (after - clean):+.1f} | "
            f"{1e3 * stall:+.1f} | {100 * stall / clean:+.2f}% | {1e3 * median(host):.1f} | "
            f"{1e3 * median(staged):.1f} |"
        )
    if not rows:
        return []
    return [
        "",
        "### d2. Checkpoint stall on the wall clock (default flags, a save after every 3rd epoch)",
        "",
        "Each epoch's wall time, from the end of one epoch's save to the end of the next's; the"
        " save's cost is the saving epoch plus the one after it (its background write runs"
        " there), each less a clean epoch of the same run (medians).",
        "",
        "| run | saves / clean epochs | clean epoch ms | saving epoch ms | epoch after ms | "
        "stall per save ms | % of an epoch | host time of the save ms | "
        "host time of the staged copy ms (before the last step's sync) |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]


def table_plain(runs: dict) -> list[str]:
    """The headline from the plain command (suite ``plain``): no probe, result.json's figures."""
    ref = next((r for k, r in runs.items() if k.startswith("plain_ref_")), None)
    ours = [(k, r) for k, r in runs.items() if r.get("kind") == "plain"]
    if ref is None and not ours:
        return []
    out = ["", "### a0. The plain command, as a user types it (no probe)", ""]
    out += [
        "Training s: the conventional script's timer around its epoch loop; for `hpc-ddp train`, "
        "result.json's `train_wall_seconds` (first step to the end of the last epoch, evaluation "
        "and checkpoints included), in brackets its `wall_seconds` (start-up added). To exit: "
        "from the shell.",
        "",
        "| run | GPUs | training s | epoch 1 s, later epochs median s | command-to-exit s | "
        "before train(), after result.json s | test acc | training speed-up | exit speed-up |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if ref is not None:
        out.append(_base_row("conventional DDP script", ref, ref.get("gpus"), plain_columns=True))
    conventional = ref if ref is not None and _ok(ref) else {}
    for key, r in ours:
        result = r.get("result") or {}
        which = ("base " if r.get("base") else "") + key.rsplit("_", 1)[-1]
        label = f"`hpc-ddp train --nproc-per-node {r.get('gpus')}` ({which})"
        if not _ok(r) or not result:
            out.append(f"| {label} | {r.get('gpus')} | {_why(r)} | | | | | | |")
            continue
        train = result.get("train_wall_seconds")
        out.append(
            f"| {label} | {r.get('gpus')} | {_f(train)} ({_f(result.get('wall_seconds'))}) | "
            f"{_epoch_split(r.get('epochs') or [])} | {_f(r.get('wall_s'))} | "
            f"{_outside_split(r.get('outside_train_s'))} | "
            f"{_f(result.get('test_accuracy'), '.4f')} | "
            f"{_f(_ratio(conventional.get('train_time_s'), train), '.1f')}x | "
            f"{_f(_ratio(conventional.get('wall_s'), r.get('wall_s')), '.1f')}x |"
        )
    return [*out, ""]


def table_exit_target(runs: dict) -> list[str]:
    """Each plain run's command-to-exit against floor + training + 1 s, the floor being the mean
    of the two measured beside it (``bench.py --floor``): import torch alone moves seconds."""
    floors = {k.rsplit("_r", 1)[-1]: r for k, r in runs.items() if r.get("kind") == "floor"}
    if not floors:
        return []
    out = ["", "### a1. Command to exit against the floors beside each run", ""]
    out += [
        "Floors: startup_floor.py timed from the shell (interpreter, import torch, forked ranks "
        "joining NCCL, one all-reduce, their exit), the one before the run and the one after it. "
        "Target: their mean + training s + 1 s.",
        "",
        "| run | floors s (import torch s) | training s | target s | command-to-exit s | met |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in runs.items():
        if r.get("kind") != "plain" or not _ok(r) or not r.get("result"):
            continue
        i = int(key.rsplit("_r", 1)[-1])
        beside = [floors.get(str(j)) for j in (i, i + 1)]
        walls = [f["wall_s"] for f in beside if f and f.get("rc") == 0]
        if not walls:
            continue
        imports = ", ".join(_f((f.get("floor") or {}).get("import_torch")) for f in beside if f)
        train = r["result"].get("train_wall_seconds") or 0.0
        target = sum(walls) / len(walls) + train + 1
        which = ("base " if r.get("base") else "") + f"r{i}"
        out.append(
            f"| {which} | {', '.join(_f(w) for w in walls)} ({imports}) | {_f(train)} | "
            f"{_f(target)} | {_f(r.get('wall_s'))} | {'yes' if r['wall_s'] <= target else 'no'} |"
        )
    return [*out, ""]


def _outside_split(outside: dict | None) -> str:
    """The exit's time outside train(): before it (start-up) and after its result.json."""
    if not outside:
        return "-"
    return f"{_f(outside['before'])}, {_f(outside['after'])}"


def _epoch_split(epochs: list[dict]) -> str:
    """Epoch 1 (CUDA's first use of each kernel, the capture) apart from the steady epochs."""
    if not epochs:
        return "-"
    later = sorted(e["seconds"] for e in epochs[1:])
    median = later[len(later) // 2] if later else None
    return f"{_f(epochs[0]['seconds'], '.3f')}, {_f(median, '.3f')}"


def table_ttfs(runs: dict) -> list[str]:
    out = ["", "### c. Time to first step (end of the first optimizer step)", ""]
    rows = [(k, r) for k, r in runs.items() if r.get("ttfs") and not k.startswith("resume")]
    if not rows:
        return [*out, "(no data)"]
    phases: list[str] = []
    for _, r in rows:
        phases += [p for p in r["ttfs"]["phases_s"] if p not in phases]
    out += [
        "| run | GPUs | from command | launcher | from process start | "
        + " | ".join(phases)
        + " |",
        "|---" * (5 + len(phases)) + "|",
    ]
    for key, r in rows:
        t = r["ttfs"]
        cells = " | ".join(_f(t["phases_s"].get(p)) for p in phases)
        out.append(
            f"| {key} | {r.get('gpus')} | {_f(t['from_command_s'])} | "
            f"{_f(t['launcher_s'])} | {_f(t['from_process_start_s'])} | {cells} |"
        )
    return out


def table_ckpt(runs: dict) -> list[str]:
    out = ["", "### d. Checkpoint stall (ResNet-18, one checkpoint per epoch) and resume", ""]
    out += [
        "| run | saves | mean stall s | state_dict s | write s | commit s | epoch s | "
        "stall % of epoch | first save s | later saves s | later % of epoch |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, r in runs.items():
        if not key.startswith(("resnet_", "weak_")) or not r.get("saves"):
            continue
        saves, hist = r["saves"], r.get("history") or []
        epoch = mean(h["seconds"] for h in hist) if hist else None
        stall = mean(s["total"] for s in saves)
        later = mean(s["total"] for s in saves[1:]) if len(saves) > 1 else None
        out.append(
            f"| {key} | {len(saves)} | {stall:.3f} | "
            f"{mean(s.get('state_dict_and_rest', 0) for s in saves):.3f} | "
            f"{mean(s.get('write', 0) for s in saves):.3f} | "
            f"{mean(s.get('commit', 0) for s in saves):.3f} | {_f(epoch, '.3f')} | "
            f"{_f(epoch and 100 * stall / epoch, '.1f')}% | {saves[0]['total']:.3f} | "
            f"{_f(later, '.3f')} | {_f(later and epoch and 100 * later / epoch, '.1f')}% |"
        )
    for key, r in runs.items():
        if key.startswith("resume_") and r.get("kind") == "resume":
            t = r.get("resume_ttfs") or {}
            ph = t.get("phases_s", {})
            same = r.get("sha_resumed") == r.get("sha_uninterrupted") and r.get("sha_resumed")
            out += [
                "",
                f"Resume ({key}): exits {r.get('first_exit')} then "
                f"{r.get('second_exit')}; resume-to-first-step {_f(t.get('from_command_s'))} s "
                f"from the command ({_f(t.get('from_process_start_s'))} s from process start; "
                f"restore {_f(ph.get('restore'), '.3f')} s); final weights "
                + (
                    "identical to the uninterrupted run's."
                    if same
                    else "differ from the uninterrupted run's (expected: this run does not ask "
                    "for deterministic cuDNN kernels; tests/test_gpu.py checks exactness)."
                ),
            ]
    return out


def table_allreduce(runs: dict, gpus: list[int]) -> list[str]:
    out = ["", "### e. Gradient all-reduce: trainer vs NCCL ceiling", ""]
    nbytes = RESNET18_CIFAR100_PARAMS * 4
    out += [
        "| GPUs | NCCL busbw at 44.7 MiB (GB/s) | NCCL busbw 1 GiB | trainer all-reduce "
        "window per step (ms) | trainer-seen busbw (GB/s) |",
        "|---|---|---|---|---|",
    ]
    for n in gpus:
        if n < 2:
            continue
        nccl = runs.get(f"nccl_{n}gpu", {}).get("rows") or []
        at = {round(r["MiB"], 1): r["busbw_GBps"] for r in nccl}
        r = runs.get(f"resnet_{n}gpu_timed") or runs.get(f"resnet_{n}gpu", {})
        hist = (r.get("history") or [])[1:] or (r.get("history") or [])
        steps = [h["step"] for h in r.get("history") or []]
        per_epoch = (steps[1] - steps[0]) if len(steps) > 1 else (steps[0] if steps else None)
        comm = mean(h["time"]["comm"] for h in hist) / per_epoch if hist and per_epoch else None
        seen = nbytes * 2 * (n - 1) / n / comm / 1e9 if comm else None
        out.append(
            f"| {n} | {_f(at.get(44.7), '.0f')} | {_f(at.get(1024.0), '.0f')} | "
            f"{_f(comm and comm * 1e3, '.2f')} | {_f(seen, '.0f')} |"
        )
    out.append("")
    out.append(
        "The trainer's window runs from the first bucket's launch to the last one's "
        "completion, so it includes backward compute between buckets: a lower bound on "
        "the bandwidth the all-reduce itself reached."
    )
    return out


def table_profile(runs: dict) -> list[str]:
    rows = [(k, r) for k, r in runs.items() if r.get("kind") == "profile" and r.get("gpus")]
    if not rows:
        return []
    out = ["", "### Step profile (ms per step; random data on the GPU; benchmarks/step_profile.py)"]
    cols = [
        "eager_ddp_ms",
        "eager_ddp_sync_ms",
        "graphed_ms",
        "graphed_sync_ms",
        "graph_replay_gpu_ms",
    ]
    out += ["", "| workload | GPUs | " + " | ".join(cols) + " |", "|---" * (2 + len(cols)) + "|"]
    for _, r in rows:
        for wl in ("lenet_b64_fp32", "resnet18_b256_bf16"):
            if wl in r:
                cells = " | ".join(_f(r[wl].get(c), ".3f") for c in cols)
                out.append(f"| {wl} | {r['gpus']} | {cells} |")
    return out


def table_tests(runs: dict) -> list[str]:
    r = runs.get("gpu_tests")
    if not r:
        return []
    return [
        "",
        f"### GPU checks (tests/test_gpu.py): rc={r.get('rc')}, {' '.join(r.get('summary') or [])}",
    ]


def tables(results: dict) -> str:
    runs = results.get("runs", {})
    meta = results.get("meta", {})
    gpus = sorted({int(r["gpus"]) for r in runs.values() if r.get("gpus")} or {1})
    head = [
        f"## Benchmarks: {meta.get('gpu_count', '?')} x {meta.get('gpu', '?')}, "
        f"{meta.get('date_utc', '?')}, torch {meta.get('torch', '?')}, NCCL "
        f"{meta.get('nccl', '?')}",
        "",
    ]
    body = (
        table_plain(runs)
        + table_exit_target(runs)
        + table_ref(runs, gpus)
        + table_scaling(runs, gpus)
        + table_weak(runs)
        + table_ttfs(runs)
        + table_ckpt(runs)
        + table_stall(runs)
        + table_allreduce(runs, gpus)
        + table_profile(runs)
        + table_tests(runs)
    )
    return "\n".join(head + body) + "\n"


if __name__ == "__main__":
    from pathlib import Path

    print(tables(json.loads(Path(sys.argv[1]).read_text())))
