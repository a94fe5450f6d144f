"""The benchmark README's pictures, drawn from bench.json files (matplotlib, Agg).

    cd benchmarks && python3 figures.py --out img --ref R/..._0529UTC/ref/bench.json \\
        --scaling "--cuda-graphs (05:22)=R/..._0522UTC/scal/bench.json:_graphs" ... \\
        --startup "torchrun, before (01:55)=R/2026-11-26_4xH200/bench.json:ours_lenet_4gpu" ...

(R = results; the exact command that drew img/ is in benchmarks/README.md.)

reference.png: training and command-to-exit time, conventional script vs hpc-ddp, per GPU count.
startup.png: time to first step split into phases, one bar per labelled run.
scaling.png: ResNet-18 weak-scaling efficiency, one line per labelled series.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from report import steady_rate  # benchmarks/report.py

PHASES = [  # (label, phase keys summed), in the order they happen
    ("import torch", ("import_torch",)),
    ("import hpc_ddp (+torchvision before)", ("import_hpc_ddp",)),
    ("process group (+torch._dynamo where imported)", ("process_group", "fork_workers")),
    ("read CIFAR", ("data_stage", "data_read")),
    ("to GPU, model, optimizer", ("data_to_device", "model_and_optimizer", "restore")),
    ("first step", ("first_step",)),
]


def load(path: str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())["runs"]


OURS = (  # (run-name suffix, label) of hpc-ddp's rows in the reference figure
    ("", "hpc-ddp --cuda-graphs"),
    ("_async", "hpc-ddp --cuda-graphs --async-checkpoint"),
    ("_first_read", "the same, first read of the files"),
)


def reference(runs: dict[str, Any], out: Path) -> None:
    counts = sorted(
        int(k.split("_")[2].removesuffix("gpu"))
        for k in runs
        if k.startswith("ref_ddp_") and runs[k].get("rc") == 0
    )
    rows: list[tuple[str, str, int]] = []  # (label, run name, GPUs), top to bottom
    for n in sorted(counts, reverse=True):
        rows.append((f"conventional DDP, {n} GPU{'s' * (n > 1)}", f"ref_ddp_{n}gpu", n))
        rows += [
            (f"{label}, {n} GPU{'s' * (n > 1)}", f"ours_lenet_{n}gpu{suffix}", n)
            for suffix, label in OURS
            if runs.get(f"ours_lenet_{n}gpu{suffix}", {}).get("rc") == 0
        ]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.3), sharey=True)
    for ax, (title, base_key, ours_key) in zip(
        axes,
        (("training", "train_time_s", "train_s"), ("command to exit", "wall_s", "wall_s")),
        strict=True,
    ):
        for i, (_, name, n) in enumerate(rows):
            base = runs[f"ref_ddp_{n}gpu"][base_key]
            if name.startswith("ref_"):
                ax.barh(i, base, 0.7, color="#bbbbbb")
                ax.text(base, i, f" {base:.1f} s", va="center", fontsize=8)
                continue
            ours = runs[name][ours_key]
            ax.barh(i, ours, 0.7, color="#1f77b4")
            ax.text(ours, i, f" {ours:.1f} s ({base / ours:.1f}x)", va="center", fontsize=8)
        ax.set(xscale="log", title=title, xlabel="seconds (log)")
        ax.set_xlim(right=ax.get_xlim()[1] * 3)
    axes[0].set_yticks(range(len(rows)), [label for label, _, _ in rows], fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("CIFAR-100 LeNet, 10 epochs, batch 64 per GPU (4 x H200)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "reference.png", dpi=90)
    plt.close(fig)


def startup(specs: list[str], out: Path) -> None:
    rows = []
    for spec in specs:
        label, where = spec.split("=", 1)
        path, key = where.rsplit(":", 1)
        ttfs = load(path)[key]["ttfs"]
        parts = [sum(ttfs["phases_s"].get(k, 0.0) for k in keys) for _, keys in PHASES]
        rows.append((label, ttfs["from_command_s"] - sum(parts), parts))
    fig, ax = plt.subplots(figsize=(10, 0.6 * len(rows) + 1.4))
    colours = plt.get_cmap("tab10").colors
    for i, (_label, launch, parts) in enumerate(rows):
        left = 0.0
        for j, width in enumerate([launch, *parts]):
            name = "launcher + interpreter" if j == 0 else PHASES[j - 1][0]
            ax.barh(i, width, left=left, color=colours[j], label=name if i == 0 else "")
            left += width
        ax.text(left, i, f" {left:.1f} s", va="center", fontsize=8)
    ax.axvline(6, color="k", ls="--", lw=0.8)
    ax.text(6, -0.55, " target 6 s", fontsize=8)
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    ax.set_ylim(len(rows) - 0.5, -0.8)  # first row on top, room for the target's label
    ax.set(xlabel="seconds from the command to the end of the first step")
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.25))
    ax.set_title("Time to first step, LeNet on 4 x H200", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "startup.png", dpi=90, bbox_inches="tight")
    plt.close(fig)


def scaling(specs: list[str], out: Path) -> None:
    """One line per ``LABEL=bench.json[+bench.json...]:SUFFIX`` (runs resnet_<n>gpu<SUFFIX>)."""
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for spec in specs:
        label, where = spec.split("=", 1)
        paths, suffix = where.rsplit(":", 1)
        runs: dict[str, Any] = {}
        for path in paths.split("+"):
            runs.update(load(path))
        base = steady_rate(runs.get(f"resnet_1gpu{suffix}", {}))
        rates = {n: steady_rate(runs.get(f"resnet_{n}gpu{suffix}", {})) for n in (1, 2, 4, 8)}
        points = [(n, rate / (n * base)) for n, rate in rates.items() if base and rate]
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, [100 * y for y in ys], marker="o", label=label)
    ax.axhline(95, color="k", ls="--", lw=0.8)
    ax.set(xlabel="GPUs", ylabel="efficiency (%)", ylim=(80, 101), xticks=[1, 2, 4])
    ax.set_title("ResNet-18 weak scaling, bf16, 256 per GPU (4 x H200)", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=90)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ref", required=True, help="bench.json with the ref suite")
    parser.add_argument("--startup", action="append", default=[], help="LABEL=bench.json:RUN")
    parser.add_argument(
        "--scaling", action="append", default=[], help="LABEL=bench.json[+bench.json]:SUFFIX"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    reference(load(args.ref), out)
    if args.scaling:
        scaling(args.scaling, out)
    if args.startup:
        startup(args.startup, out)


if __name__ == "__main__":
    main()
